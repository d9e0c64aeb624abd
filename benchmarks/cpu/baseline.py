"""The plain loop row 1 compares against: transformers + peft + accelerate + bitsandbytes, written the way
their documentation shows a QLoRA loop, with finetune's tiny recipe's numbers.

Same as finetune's run: the builtin tiny Llama in NF4 with double quantization (bf16 compute, or fp32 on a
CPU without native bf16 as finetune resolves it; fp32 storage, fp32 non-quantized weights), LoRA r/alpha/dropout on all linear layers, the same tokenized
examples in the same order and micro-batch (padded to the longest in the batch), bitsandbytes' 8-bit AdamW
with the recipe's hyper-parameters, cosine schedule, gradient clipping, bf16 autocast (here through
Accelerate's mixed_precision, the plain way). What it does not share with finetune is the loop itself:
HF's built-in loss, a DataLoader with transformers' collator, Accelerate's prepared objects.
"""
from __future__ import annotations

import random
import time


def plain_run(overrides: list[str], warmup: int, steps: int) -> dict:
    """Train warmup + steps optimizer steps; trained tokens/s and s/step over the last `steps`."""
    import bitsandbytes as bnb
    import torch
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        BitsAndBytesConfig,
        DataCollatorForSeq2Seq,
        get_cosine_schedule_with_warmup,
    )

    from benchmarks.common import TINY_RECIPE
    from finetune import recipe as recipe_mod
    from finetune.data.prepare import prepare
    from finetune.util import builtin as tiny

    from benchmarks.common import resolved_precision
    from finetune.util.dtypes import torch_dtype

    rec = recipe_mod.load(TINY_RECIPE, overrides)  # read for its numbers only; none of its code runs below
    # and the precision finetune resolves here: fp32 compute on a CPU without native bf16 (train/precision.py)
    rec = resolved_precision(rec)
    t, lo = rec.train, rec.lora
    acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=t.mixed_precision)
    torch.manual_seed(t.seed)
    path = tiny.model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    # the same tokenized rows as finetune's run, as plain {input_ids, labels} features for the collator
    examples = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in prepare(rec.data, tok).train]
    random.Random(rec.data.shuffle_seed * 1000).shuffle(examples)  # and finetune's epoch-0 order

    bnb_cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch_dtype(rec.quantization.compute_dtype),
                                 bnb_4bit_quant_storage=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_cfg, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=rec.model.gradient_checkpointing,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    total = warmup + steps
    opt = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=t.learning_rate,
                              betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, weight_decay=t.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, t.warmup_steps, total)
    loader = DataLoader(examples, batch_size=t.micro_batch_size, shuffle=False, drop_last=True,
                        collate_fn=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    model.train()
    batches = iter(loader)
    tokens, t0, first_loss = 0, time.perf_counter(), None
    for step in range(1, total + 1):
        if step == warmup + 1:
            tokens, t0 = 0, time.perf_counter()
        batch = next(batches)
        out = model(**batch, use_cache=False)
        acc.backward(out.loss)
        if t.max_grad_norm:
            acc.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()  # a loop reports its loss; finetune's does too
        first_loss = loss if first_loss is None else first_loss
        tokens += int((batch["labels"][:, 1:] != -100).sum())
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "s_per_step": seconds / steps, "steps": steps, "tokens": tokens,
            "seconds": seconds, "threads": torch.get_num_threads(), "first_loss": first_loss}
