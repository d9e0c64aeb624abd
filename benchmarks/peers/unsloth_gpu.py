"""The speed stage's unsloth arm (benchmarks/gpu/speed.py `stage_speed_unsloth`), as an unsloth user sets it up.

    PYTHONPATH=/tmp/usite python3 benchmarks/peers/unsloth_gpu.py '{"model_dir": DIR, "rows": ROWS.json,
        "seq": 2048, "warmup": 4, "steps": 8, "work": DIR}'

Runs in an interpreter whose path holds only unsloth's wheels (transformers <= 5.17: the GPU image's), so it
imports nothing of finetune: the speed stage hands it the synthetic 8B's directory and the rows the TRL arm
trains on (seeded random ids, exactly `seq` long, every token trained). Same micro-batch 2, LoRA r16 / alpha 32
on every linear layer of the decoder, no dropout, paged 8-bit AdamW, bf16, NF4 4-bit base; unsloth's own
gradient checkpointing ("unsloth") and kernels. Prints one JSON line: trained tokens/s over the steps after the
warm-up, peak allocated and reserved memory, the loss and gradient-norm curves, the attention the model
resolved, the host (thread CPU) time per step and the versions it ran with.
"""
from __future__ import annotations

import json
import os
import sys
import time

GIB = 2**30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # all-linear, no head


def main(argv: list[str]) -> int:
    s = json.loads(argv[0])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched: the model is a local directory
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    import unsloth  # first, as unsloth asks: it patches transformers, peft and trl on import
    from unsloth import FastLanguageModel

    import datasets
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    steps = s["warmup"] + s["steps"]
    model, tok = FastLanguageModel.from_pretrained(model_name=s["model_dir"], max_seq_length=s["seq"],
                                                   dtype=torch.bfloat16, load_in_4bit=True)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             bias="none", use_gradient_checkpointing="unsloth", random_state=0)
    tok.pad_token = tok.pad_token or tok.eos_token
    rows = json.loads(open(s["rows"]).read())
    cfg = SFTConfig(output_dir=f"{s['work']}/unsloth", max_steps=steps, per_device_train_batch_size=2,
                    gradient_accumulation_steps=1, learning_rate=2e-4, warmup_steps=1, optim="paged_adamw_8bit",
                    bf16=True, max_length=s["seq"], packing=False, logging_steps=1, save_strategy="no",
                    eval_strategy="no", report_to="none", disable_tqdm=True, dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=cfg, processing_class=tok, train_dataset=datasets.Dataset.from_list(rows))
    marks, host = [], []

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            host.append(time.thread_time())

        def on_step_end(self, args, state, control, **kw):
            host[-1] = time.thread_time() - host[-1]  # the step's launches and bookkeeping, before the sync
            torch.cuda.synchronize()
            marks.append((state.global_step, time.perf_counter()))

    trainer.add_callback(Marks())
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    timed = [m for m in marks if m[0] >= s["warmup"]]
    per_step = (timed[-1][1] - timed[0][1]) / max(1, timed[-1][0] - timed[0][0])
    logged = [h for h in trainer.state.log_history if "loss" in h]
    out = {"tokens_per_s": 2 * (s["seq"] - 1) / per_step, "s_per_step": per_step, "timed_steps": len(timed) - 1,
           "seconds": time.perf_counter() - t0, "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
           "losses": [h["loss"] for h in logged], "grad_norms": [h.get("grad_norm") for h in logged],
           "attention": getattr(model.config, "_attn_implementation", None),
           "host_s_per_step": sum(host[s["warmup"]:]) / max(1, len(host[s["warmup"]:])),
           "versions": {m.__name__: getattr(m, "__version__", None) for m in (unsloth, transformers, trl, datasets, torch)}}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
