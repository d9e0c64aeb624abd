"""The two sides of row 7 (benchmarks/peers/trl_sft.py), each run as `python -m benchmarks.peers.trl_arms ARM SETTINGS_JSON`
in a fresh interpreter, so each pays for its own imports and nothing else, and its peak RSS (VmHWM) is its own.

`finetune`: finetune's loop as a user runs it (`finetune.train.loop.train` on the tiny recipe), reading its rows
through finetune's data preparation. `trl` / `trl_fp32_adapters`: TRL's SFTTrainer configured as TRL's docs show
QLoRA, with the recipe's numbers and the rows finetune exported (pre-tokenized `input_ids` + `labels`), loading
the same 4-bit base; `trl_fp32_adapters` undoes SFTTrainer's cast of the LoRA weights to bf16 (the ablation).

Each prints one JSON line: trained tokens/s after the first `window` steps, peak RSS, RSS at phases, the
digest of the rows it trained on, where its adapter went.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def rss() -> dict:
    """This process's resident set now and its high-water mark, bytes (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return {"rss": out.get("VmRSS"), "peak": out.get("VmHWM")}


def rate_between(marks: list[tuple[int, float, int]], after_step: int) -> dict:
    """Trained tokens/s over the steps after `after_step`, from (step, time at its end, its trained tokens)."""
    start = [m for m in marks if m[0] == after_step]
    later = [m for m in marks if m[0] > after_step]
    if not start or not later:
        raise ValueError(f"no steps after step {after_step} among {len(marks)}")
    seconds = later[-1][1] - start[0][1]
    tokens = sum(m[2] for m in later)
    return {"tokens_per_s": tokens / seconds, "s_per_step": seconds / len(later), "steps": len(later),
            "tokens": tokens, "seconds": seconds}


def finetune_arm(s: dict) -> dict:
    phases = {"start": rss()}
    from benchmarks.common import TINY_RECIPE, read_jsonl, steady_rate
    from finetune import recipe as recipe_mod
    from finetune.train import loop

    phases["imported"] = rss()
    out = Path(s["out"])
    rec = recipe_mod.load(TINY_RECIPE, s["overrides"] + [f"output.dir={out}"])
    from benchmarks.peers.trl_compare import digest

    seen = {}
    prepare = loop.prepare_data

    def prepare_and_digest(*args, **kwargs):  # the rows finetune trains on, for the identical-tokens check
        prepared = prepare(*args, **kwargs)
        seen["digest"], seen["rows"] = digest(prepared.train), len(prepared.train)
        return prepared

    loop.prepare_data = prepare_and_digest
    final = loop.train(rec, out)
    phases["trained"] = rss()
    records = read_jsonl(out / "metrics.jsonl")
    return {**steady_rate(records, after_step=s["window"]), "peak_rss": phases["trained"]["peak"],
            "phases": phases, "rows_digest": seen["digest"], "rows": seen["rows"],
            "adapter": str(out / "adapter"), "own_eval_loss": final.get("eval_loss"),
            "first_loss": records[0]["loss"], "final_loss": final.get("loss")}


def _trl_config(s: dict, out: Path):
    import torch
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig

    r = s["recipe"]
    # The base exactly as finetune loads it (finetune.weights.bnb.bnb_config / finetune.weights.load.model.load_model): NF4, double
    # quantization, fp32 storage and fp32 non-quantized weights, and the compute precision finetune resolves
    # here (bf16; fp32 on a CPU without native bf16, where bf16 costs both sides 10x).
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=getattr(torch, r["compute_dtype"]),
                               bnb_4bit_quant_storage=torch.float32)
    return SFTConfig(
        output_dir=str(out), max_steps=s["steps"], per_device_train_batch_size=r["micro_batch_size"],
        gradient_accumulation_steps=1, learning_rate=r["learning_rate"], lr_scheduler_type=r["lr_scheduler"],
        warmup_steps=r["warmup_steps"], weight_decay=r["weight_decay"], adam_beta1=r["adam_beta1"],
        adam_beta2=r["adam_beta2"], adam_epsilon=r["adam_epsilon"], max_grad_norm=r["max_grad_norm"],
        optim=r["optimizer"], bf16=r["mixed_precision"] == "bf16", use_cpu=not torch.cuda.is_available(), seed=s["seed"],
        gradient_checkpointing=r["gradient_checkpointing"], max_length=r["max_seq_len"], packing=False,
        dataloader_drop_last=True, logging_steps=s["window"], save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, dataset_num_proc=None,
        model_init_kwargs={"dtype": torch.float32, "quantization_config": quant, "attn_implementation": "sdpa"})


def trl_arm(s: dict, fp32_adapters: bool = False) -> dict:
    phases = {"start": rss()}
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTTrainer

    phases["imported"] = rss()
    out, r = Path(s["out"]), s["recipe"]
    rows = json.loads(Path(s["rows"]).read_text())
    train_rows, eval_rows = datasets.Dataset.from_list(rows["train"]), datasets.Dataset.from_list(rows["eval"])
    del rows  # the arrow tables hold them now
    tok = AutoTokenizer.from_pretrained(s["model_dir"])
    tok.pad_token = tok.pad_token or tok.eos_token  # as finetune.weights.load.resolve.load_tokenizer does
    lora = LoraConfig(r=r["lora_r"], lora_alpha=r["lora_alpha"], lora_dropout=r["lora_dropout"],
                      target_modules=r["target_modules"], bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(s["seed"])  # finetune seeds right before get_peft_model too (train.lora.apply_lora)
    trainer = SFTTrainer(model=s["model_dir"], args=_trl_config(s, out), processing_class=tok, peft_config=lora,
                         train_dataset=train_rows, eval_dataset=eval_rows)
    if fp32_adapters:  # undo SFTTrainer's bf16 cast of the adapters: fp32 master weights, as finetune keeps
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    adapter_dtype = str(next(p.dtype for p in trainer.model.parameters() if p.requires_grad))
    from benchmarks.peers.trl_compare import digest

    trained = digest(trainer.train_dataset), len(trainer.train_dataset)  # streamed: no copy of the rows kept
    marks, step_tokens = [], [0]
    original_step = trainer.training_step

    def counting_step(model, inputs, *args, **kwargs):  # trained tokens as the shifted loss counts them
        step_tokens[0] += int((inputs["labels"][:, 1:] != -100).sum())
        return original_step(model, inputs, *args, **kwargs)

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks.append((state.global_step, time.perf_counter(), step_tokens[0]))
            step_tokens[0] = 0

    trainer.training_step = counting_step
    trainer.add_callback(Marks())
    phases["ready"] = rss()
    trainer.train()
    own_eval = trainer.evaluate()["eval_loss"]  # finetune's run ends with a held-out pass too
    trainer.save_model(str(out / "adapter"))
    phases["trained"] = rss()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {**rate_between(marks, s["window"]), "peak_rss": phases["trained"]["peak"], "phases": phases,
            "rows_digest": trained[0], "rows": trained[1], "adapter": str(out / "adapter"),
            "own_eval_loss": own_eval, "adapter_dtype": adapter_dtype, "final_loss": losses[-1] if losses else None}


ARMS = {"finetune": finetune_arm, "trl": trl_arm, "trl_fp32_adapters": lambda s: trl_arm(s, fp32_adapters=True)}


def main(argv: list[str]) -> int:
    arm, settings = argv[0], json.loads(argv[1])
    print(json.dumps(ARMS[arm](settings), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
