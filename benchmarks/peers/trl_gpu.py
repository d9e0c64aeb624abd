"""The GPU proof's TRL arm: SFTTrainer (peft + bitsandbytes) on the proof's 8B model, as a TRL user sets it up.

    python -m benchmarks.peers.trl_gpu '{"m8": NAME, "seq": 2048, "warmup": 4, "steps": 8, "work": DIR}'

Same model files, the same kind of rows (seeded random ids, exactly `seq` long, every token trained), micro-batch
2, LoRA r16 / alpha 32 on every linear layer, paged 8-bit AdamW, bf16, gradient checkpointing, NF4 with double
quantization and bf16 compute. TRL's own defaults elsewhere (its quant storage: uint8). Prints one JSON line:
trained tokens/s over the steps after the warm-up, torch's peak allocated and reserved memory, the loss and
gradient-norm curves, the attention implementation the model resolved and the host (thread CPU) time per step.
"""
from __future__ import annotations

import json
import sys
import time

GIB = 2**30


def main(argv: list[str]) -> int:
    s = json.loads(argv[0])
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from finetune.weights.built.synthetic import synthetic_dir
    from finetune.util.synthetic_names import token_rows

    model_dir = str(synthetic_dir(s["m8"]))
    cuda = torch.cuda.is_available()
    steps = s["warmup"] + s["steps"]
    vocab = json.loads(open(f"{model_dir}/config.json").read())["vocab_size"]
    opts = {"rows": 2 * steps + 8, "min_len": s["seq"], "max_len": s["seq"], "vocab": vocab, "seed": 0}
    rows = list(token_rows(opts, "train", vocab))
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16 if cuda else torch.float32)
    cfg = SFTConfig(output_dir=f"{s['work']}/trl", max_steps=steps, per_device_train_batch_size=2,
                    gradient_accumulation_steps=1, learning_rate=2e-4, warmup_steps=1, optim="paged_adamw_8bit" if cuda
                    else "adamw_8bit", bf16=cuda, use_cpu=not cuda, gradient_checkpointing=True,
                    max_length=s["seq"], packing=False, logging_steps=1, save_strategy="no", eval_strategy="no",
                    report_to="none", disable_tqdm=True, dataset_num_proc=None,
                    model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32,
                                       "quantization_config": quant, "attn_implementation": "sdpa"})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", bias="none",
                      task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model_dir, args=cfg, processing_class=tok, peft_config=lora,
                         train_dataset=datasets.Dataset.from_list(rows))
    marks, host = [], []

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            host.append(time.thread_time())

        def on_step_end(self, args, state, control, **kw):
            host[-1] = time.thread_time() - host[-1]  # the step's launches and bookkeeping, before the sync
            if cuda:
                torch.cuda.synchronize()
            marks.append((state.global_step, time.perf_counter()))

    trainer.add_callback(Marks())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    timed = [m for m in marks if m[0] >= s["warmup"]]
    per_step = (timed[-1][1] - timed[0][1]) / max(1, timed[-1][0] - timed[0][0])
    tokens_per_step = 2 * (s["seq"] - 1)  # shifted labels: every position but the first is trained
    out = {"tokens_per_s": tokens_per_step / per_step, "s_per_step": per_step, "timed_steps": len(timed) - 1,
           "seconds": time.perf_counter() - t0, "adapter_dtype": str(next(p.dtype for p in trainer.model.parameters()
                                                                          if p.requires_grad)),
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "grad_norms": [h.get("grad_norm") for h in trainer.state.log_history if "loss" in h],
           "attention": trainer.model.config._attn_implementation,  # what the model resolved
           "host_s_per_step": sum(host[s["warmup"]:]) / max(1, len(host[s["warmup"]:]))}
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
