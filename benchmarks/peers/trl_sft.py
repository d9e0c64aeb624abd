"""Row 7: finetune against TRL's SFTTrainer, the tool users would pick instead, on the default recipe.

Both train the builtin tiny Llama in 4 bits on the rows finetune's data preparation makes (exported as
pre-tokenized `input_ids` + `labels` for TRL, checked to be identical token for token), with the same LoRA,
optimizer, schedule and micro-batch. Per seed, each arm runs in a fresh interpreter (benchmarks/peers/trl_arms.py),
the arms alternating in order from one seed to the next. Then one scorer (finetune's held-out loss and greedy
exact match, base + saved adapter) scores every adapter. The third arm is the ablation of the largest
difference that stays: SFTTrainer with its adapters kept in fp32, as finetune keeps them.

    python -m benchmarks.peers.trl_sft [--seeds 1,2,3] [--steps 150] [--window 20]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, TINY_RECIPE, child_env, last_json_line
from benchmarks.peers.trl_compare import compare_batches, digest, loss_not_worse, spread

ARMS = ["finetune", "trl", "trl_fp32_adapters"]
DIFFERENCES = [
    "Adapter precision: SFTTrainer casts the LoRA weights of a quantized model to bf16 (so the 8-bit AdamW "
    "updates bf16 weights), with bf16=False too; finetune keeps fp32 master weights. The ablation arm keeps "
    "TRL's adapters in fp32. On a CPU without native bf16 the cast also puts TRL's LoRA matmuls on torch's "
    "slow bf16 kernel (measured: about half the fp32 arm's tokens/s), so there the ablation arm is the "
    "like-for-like speed comparison.",
    "Data order: each shuffles with its own sampler (finetune: `data.shuffle_seed` and the epoch; TRL: "
    "the Trainer's seeded RandomSampler). The rows are the same; the seed sets both tools' order.",
    "Loss and per-step metrics: SFTTrainer's fused LM head projects the hidden states through the head in "
    "chunks (on CPU every position, masking afterwards; on CUDA with Triton only trained ones) under bf16 "
    "autocast and computes log-probabilities, entropy and top-1 of each, then reduces entropy and token "
    "accuracy to Python floats every step; finetune runs the head and an fp32 loss on trained positions only "
    "and logs the loss.",
    "Attention kernel: finetune picks SDPA's math kernel for short CPU bf16 batches "
    "(`finetune.plan.attention`); SFTTrainer leaves the choice to torch.",
    "End of run: finetune writes a final checkpoint (adapter + optimizer state) and the adapter; "
    "SFTTrainer saves the adapter. Both run one held-out pass (finetune's own, `trainer.evaluate()`).",
]


def overrides(seed: int, steps: int, window: int) -> list[str]:
    """The default recipe at `steps` steps: the seed sets the model seed and the data order; logs every
    `window` steps (the first window is the warm-up left out of tokens/s); no intermediate checkpoints."""
    return [f"train.max_steps={steps}", f"train.seed={seed}", f"data.shuffle_seed={seed}",
            f"train.log_every={window}", "train.save_every=null", "train.eval_every=null",
            "output.progress_bar=false", "train.resume=false",
            *(["train.warmup_steps=1"] if steps <= 20 else [])]  # quick runs: the recipe's 20 would not fit


def recipe_numbers(rec) -> dict:
    """What TRL's side is configured from: the recipe's numbers, in Trainer's names where they differ, and
    the precision finetune resolves on this machine (fp32 compute on a CPU without native bf16)."""
    from benchmarks.common import resolved_precision

    rec = resolved_precision(rec)
    t, lo = rec.train, rec.lora
    optim = {"paged_adamw_8bit": "paged_adamw_8bit", "adamw_8bit": "adamw_bnb_8bit",
             "adamw_torch": "adamw_torch"}[t.optimizer]
    sched = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[t.lr_scheduler]
    return {"micro_batch_size": t.micro_batch_size, "learning_rate": t.learning_rate, "lr_scheduler": sched,
            "warmup_steps": t.warmup_steps, "weight_decay": t.weight_decay, "adam_beta1": t.adam_beta1,
            "adam_beta2": t.adam_beta2, "adam_epsilon": t.adam_epsilon, "max_grad_norm": t.max_grad_norm,
            "optimizer": optim, "gradient_checkpointing": rec.model.gradient_checkpointing,
            "max_seq_len": rec.data.max_seq_len, "lora_r": lo.r, "lora_alpha": lo.alpha,
            "lora_dropout": lo.dropout, "target_modules": lo.target_modules,
            "mixed_precision": t.mixed_precision, "compute_dtype": rec.quantization.compute_dtype}


def export(seed: int, steps: int, window: int, tmp: Path) -> dict:
    """finetune's prepared rows for this seed, written for TRL's side; the settings both arms get."""
    from finetune import recipe as recipe_mod
    from finetune.data.prepare import prepare
    from finetune.weights.load.resolve import load_tokenizer, resolve_name

    ov = overrides(seed, steps, window)
    rec = recipe_mod.load(TINY_RECIPE, ov)
    prepared = prepare(rec.data, load_tokenizer(rec.model))
    pick = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in prepared.train]
    rows = tmp / f"rows-{seed}.json"
    rows.write_text(json.dumps({"train": pick, "eval": [{"input_ids": e["input_ids"], "labels": e["labels"]}
                                                        for e in prepared.eval]}))
    return {"seed": seed, "steps": steps, "window": window, "overrides": ov, "rows": str(rows),
            "digest": digest(pick), "n_rows": len(pick), "recipe": recipe_numbers(rec),
            "model_dir": resolve_name(rec.model.name)}


def run_arm(arm: str, settings: dict, out: Path, timeout: float, threads: int | None) -> dict:
    """One training run in a fresh interpreter; its JSON result."""
    cmd = [sys.executable, "-m", "benchmarks.peers.trl_arms", arm, json.dumps({**settings, "out": str(out)})]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{arm} (seed {settings['seed']}) exited {proc.returncode}:\n{tail}")
    return last_json_line(proc.stdout)


def score(adapter: str, seed: int, steps: int, window: int, extra: tuple = ()) -> dict:
    """Held-out loss and greedy exact match of base + adapter, finetune's `eval` scorer for every arm."""
    from peft import PeftModel

    from benchmarks.common import resolved_precision
    from finetune import recipe as recipe_mod
    from finetune.data import encode
    from finetune.data.prepare import prepare
    from finetune.train.inference import exact_match, heldout_loss
    from finetune.weights.load.model import load_model
    from finetune.weights.load.resolve import load_tokenizer

    rec = recipe_mod.load(TINY_RECIPE, [*overrides(seed, steps, window), *extra])
    # as `finetune eval` scores a run: with the precision its recipe.yaml holds (resolved for this machine)
    rec = resolved_precision(rec)
    tok = load_tokenizer(rec.model)
    prepared = prepare(rec.data, tok)
    model = PeftModel.from_pretrained(load_model(rec.model, rec.quantization, quiet=True), adapter)
    model.eval()
    return {"eval_loss": heldout_loss(model, prepared.eval, rec),
            "exact_match": exact_match(model, tok, prepared.eval_rows, rec.eval.exact_match_samples,
                                       rec.eval.max_new_tokens, encode.chat_template(rec.data, tok))}


def collators_agree(settings: dict, batches: int) -> dict:
    """finetune's collate and TRL's DataCollatorForLanguageModeling on the same exported rows."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from finetune.data.batching import collate
    from finetune.weights.load.resolve import load_tokenizer
    from finetune.recipe import load

    tok = load_tokenizer(load(TINY_RECIPE, settings["overrides"]).model)
    rows = json.loads(Path(settings["rows"]).read_text())["train"]
    theirs_fn = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id)
    mb, ok = settings["recipe"]["micro_batch_size"], 0
    for i in range(batches):
        chunk = rows[i * mb:(i + 1) * mb]
        ours = {k: v.tolist() for k, v in collate(chunk, tok.pad_token_id).items()}
        theirs = {k: v.tolist() for k, v in theirs_fn([dict(e) for e in chunk]).items()}
        ok += compare_batches(ours, theirs)["identical"]
    return {"batches_checked": batches, "batches_identical": ok == batches}


def summarise(samples: dict, checks: dict, seeds: list[int], steps: int, window: int, numbers: dict) -> dict:
    arms = {}
    for arm, xs in samples.items():
        arms[arm] = {k: spread([x[k] for x in xs]) for k in ("tokens_per_s", "peak_rss", "eval_loss",
                                                             "exact_match", "own_eval_loss")}
    ft, trl = arms["finetune"], arms["trl"]
    import trl as trl_pkg

    return {"tokens_per_s_ratio": ft["tokens_per_s"]["median"] / trl["tokens_per_s"]["median"],
            "peak_rss_ratio": ft["peak_rss"]["median"] / trl["peak_rss"]["median"],
            "loss_not_worse": loss_not_worse([x["eval_loss"] for x in samples["finetune"]],
                                             [x["eval_loss"] for x in samples["trl"]]),
            "eval_loss_mean": {a: arms[a]["eval_loss"]["mean"] for a in arms},
            "arms": arms, "samples": samples, "checks": checks, "seeds": seeds, "steps": steps, "window": window,
            "recipe": numbers, "differences": DIFFERENCES, "trl_version": trl_pkg.__version__}


def run(seeds: tuple = (1, 2, 3), steps: int = 150, window: int = 20, arms: tuple = tuple(ARMS),
        check_batches: int = 20, timeout: float = 900, threads: int | None = None) -> dict:
    if importlib.util.find_spec("trl") is None:
        return {"available": False, "reason": "trl is not installed (it is a finetune dependency: "
                                              "pip install -c constraints.txt -e .)"}
    samples: dict[str, list] = {a: [] for a in arms}
    digests_equal, rows, batch_checks = True, None, []
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        tmp = Path(tmp)
        for i, seed in enumerate(seeds):
            settings = export(seed, steps, window, tmp)
            rows = settings["n_rows"]
            batch_checks.append(collators_agree(settings, check_batches))
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                t0 = time.perf_counter()
                got = run_arm(arm, settings, tmp / f"{arm}-{seed}", timeout, threads)
                got.update(seed=seed, wall_s=round(time.perf_counter() - t0, 1),
                           **score(got["adapter"], seed, steps, window))
                digests_equal &= got["rows_digest"] == settings["digest"] and got["rows"] == rows
                samples[arm].append(got)
    checks = {"digests_equal": digests_equal, "rows": rows, "batches_checked": sum(
        c["batches_checked"] for c in batch_checks), "batches_identical": all(c["batches_identical"]
                                                                             for c in batch_checks)}
    return summarise(samples, checks, list(seeds), steps, window, settings["recipe"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--arms", default=",".join(ARMS))
    a = ap.parse_args()
    res = run(tuple(int(s) for s in a.seeds.split(",")), a.steps, a.window, tuple(a.arms.split(",")))
    print(json.dumps(res, indent=1, default=str))
