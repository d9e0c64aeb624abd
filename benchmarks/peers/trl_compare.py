"""Row 7's pure parts: the identical-tokens checks, the per-arm statistics and the RESULTS.md section.

No torch here: the checks take rows and batches as plain lists, so a unit test runs them without a model.
"""
from __future__ import annotations

import hashlib
import json
import statistics

IGNORE = -100


def _row(e) -> tuple[list[int], list[int]]:
    return [int(t) for t in e["input_ids"]], [int(t) for t in e["labels"]]


def digest(rows) -> str:
    """sha256 of the rows' input ids and labels, in order: two tools trained on the same rows, token for
    token and label for label, exactly when their digests are equal. Streams (keeps no copy)."""
    h = hashlib.sha256()
    for e in rows:
        h.update(json.dumps(_row(e), separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def compare_rows(expected: list, got: list) -> dict:
    """Row-by-row comparison of two tokenized data sets: counts, and the first row that differs."""
    first = None
    mismatched = 0
    for i, (a, b) in enumerate(zip(expected, got)):
        if _row(a) != _row(b):
            mismatched += 1
            first = i if first is None else first
    mismatched += abs(len(expected) - len(got))
    return {"rows_expected": len(expected), "rows_got": len(got), "mismatched": mismatched,
            "first_mismatch": first, "identical": mismatched == 0}


def compare_batches(ours: dict, theirs: dict) -> dict:
    """Two collated micro-batches ({input_ids, labels[, attention_mask]} as nested lists) against each other
    where it matters: the same shape, the same labels everywhere, the same input ids wherever the labels or
    the attention mask say a position is real (pad ids may differ: they are masked out of attention and
    loss). Returns what differs."""
    diffs = []
    if len(ours["labels"]) != len(theirs["labels"]) or any(
            len(a) != len(b) for a, b in zip(ours["labels"], theirs["labels"])):
        return {"identical": False, "diffs": ["shapes differ"]}
    if ours["labels"] != theirs["labels"]:
        diffs.append("labels")
    mask_a = ours.get("attention_mask") or [[1] * len(r) for r in ours["input_ids"]]
    mask_b = theirs.get("attention_mask") or [[1] * len(r) for r in theirs["input_ids"]]
    if mask_a != mask_b:
        diffs.append("attention_mask")
    for ra, rb, m in zip(ours["input_ids"], theirs["input_ids"], mask_a):
        if any(x != y for x, y, keep in zip(ra, rb, m) if keep):
            diffs.append("input_ids")
            break
    return {"identical": not diffs, "diffs": diffs}


def spread(xs: list[float]) -> dict:
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return {"median": None, "mean": None, "min": None, "max": None, "stdev": None, "n": 0}
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def loss_not_worse(ours: list[float], theirs: list[float]) -> bool:
    """finetune's held-out loss is not worse than TRL's when its mean over seeds is at most TRL's mean plus
    the larger of the two seed spreads (max - min): a difference inside seed noise is no difference."""
    a, b = spread(ours), spread(theirs)
    if a["n"] == 0 or b["n"] == 0:
        return False
    noise = max(a["max"] - a["min"], b["max"] - b["min"])
    return a["mean"] <= b["mean"] + noise


def _f(x, digits=4):
    return "n/a" if x is None else (f"{x:.{digits}g}" if isinstance(x, float) else str(x))


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:.1f}"


ARM_NAMES = {"finetune": "finetune", "trl": "TRL SFTTrainer",
             "trl_fp32_adapters": "TRL SFTTrainer, fp32 adapters (ablation)"}


def _autocast(recipe: dict) -> str:
    if recipe.get("mixed_precision", "bf16") == "bf16":
        return "bf16 autocast"
    return ("no autocast (fp32 compute: finetune's choice on a CPU without native bf16, given to both sides; "
            "the TRL docs' bf16=True would cost TRL 10x here)")


def section(r: dict) -> list[str]:
    """RESULTS.md's section for row 7: the table of medians, every sample, the checks and the differences."""
    arms = list(r["arms"])
    lines = [
        f"finetune (`finetune.train.loop.train`, recipes/tiny_cpu.yaml with `train.max_steps={r['steps']}`) "
        f"against TRL {r.get('trl_version', '?')}'s `SFTTrainer` configured the way TRL's docs show QLoRA, on "
        "the rows finetune's data preparation exported. Same 4-bit base (NF4, double quantization, "
        f"{r['recipe'].get('compute_dtype', 'bfloat16')} compute, fp32 storage), LoRA r={r['recipe']['lora_r']} alpha={r['recipe']['lora_alpha']} on all "
        f"linear layers, `{r['recipe']['optimizer']}` (bitsandbytes; on CPU neither pages), "
        f"lr {r['recipe']['learning_rate']} {r['recipe']['lr_scheduler']} with {r['recipe']['warmup_steps']} "
        f"warm-up steps, micro-batch {r['recipe']['micro_batch_size']}, clip {r['recipe']['max_grad_norm']}, "
        f"{_autocast(r['recipe'])}, gradient checkpointing {'on' if r['recipe']['gradient_checkpointing'] else 'off'} on "
        f"both (the recipe's; SFTConfig's default is on), padding to the longest row of each micro-batch, "
        f"the last partial micro-batch dropped. Seeds {r['seeds']} (model seed and data order); each run a fresh interpreter, the arms "
        "alternating in order seed by seed. Tokens/s: trained tokens (labels != -100 after the shift) over "
        f"the steps after the first {r['window']}. Peak RSS: the run's VmHWM. Held-out loss and exact match: "
        "one scorer (finetune's `eval`: base + saved adapter) for every adapter.", "",
        "| arm | trained tokens/s (median) | peak RSS MiB (median) | held-out loss (mean, min-max) | "
        "exact match (mean) |", "|---|---|---|---|---|"]
    for a in arms:
        x = r["arms"][a]
        lines.append(f"| {ARM_NAMES.get(a, a)} | {_f(x['tokens_per_s']['median'])} | "
                     f"{_mib(x['peak_rss']['median'])} | {_f(x['eval_loss']['mean'])} "
                     f"({_f(x['eval_loss']['min'])}-{_f(x['eval_loss']['max'])}) | {_f(x['exact_match']['mean'], 3)} |")
    lines += ["", f"finetune / TRL: tokens/s **{_f(r['tokens_per_s_ratio'], 3)}x**, peak RSS "
                  f"**{_f(r['peak_rss_ratio'], 3)}x**, held-out loss not worse: **{r['loss_not_worse']}**.", "",
              "Every sample, in seed order:", "", "| arm | seed | tokens/s | peak RSS MiB | held-out loss | "
              "exact match | TRL's / finetune's own eval loss |", "|---|---|---|---|---|---|---|"]
    for a in arms:
        for s in r["samples"][a]:
            lines.append(f"| {ARM_NAMES.get(a, a)} | {s['seed']} | {_f(s['tokens_per_s'])} | {_mib(s['peak_rss'])} "
                         f"| {_f(s['eval_loss'])} | {_f(s['exact_match'], 3)} | {_f(s.get('own_eval_loss'))} |")
    c = r["checks"]
    lines += ["", f"Identical input: every run's training rows hashed to the exported rows' digest: "
                  f"**{c['digests_equal']}** ({c['rows']} rows); TRL's collator and finetune's on the same rows "
                  f"({c['batches_checked']} micro-batches): **{c['batches_identical']}**.", "",
              "What cannot be made equal (each side as its users run it):", ""]
    lines += [f"- {d}" for d in r["differences"]]
    return lines
