"""Trained tokens per second with padding-free packing against dynamic padding, on length-skewed data.

The data: N_EXAMPLES prompt/completion rows, 7 in 8 short and every eighth up to ~8 times longer (as SFT
data often is), encoded by finetune's own pipeline. Packing efficiency and padding fractions are measured
on the whole set (rows of MAX_LEN; micro-batches of BATCH).

The speed: real QLoRA steps on the builtin tiny model (4-bit NF4 base via finetune.weights.load.model.load_model, LoRA
via finetune.train.lora.apply_lora, the loop's own loss finetune.train.loss.token_loss_sum, 8-bit AdamW). The first
TIMED_ROWS packed rows, and the very same examples dynamically padded (seeded order, batches of BATCH
examples padded to their longest), each make one optimizer step whose micro-batches are accumulated as
the training loop does. Packed and padded steps alternate, REPEATS of each after one warm-up each, and
the medians of trained tokens/s are compared.

Both sides pay for one optimizer update, so the difference is forward/backward work: packing computes no
padding and needs fewer micro-batches for the same examples. On this 2.6M-parameter model the fixed cost
per micro-batch is a large share, so the speedup can exceed 1 / (1 - padding_fraction_unpacked), which
is what a large, compute-bound model tends towards.

    python -m benchmarks.cpu.packing         # prints the figures; run() returns them
"""
from __future__ import annotations

import json
import random
import statistics
import time

N_EXAMPLES, MAX_LEN, BATCH, TIMED_ROWS, REPEATS = 1500, 128, 8, 8, 5


def skewed_rows(n: int, seed: int = 0) -> list[dict]:
    """Prompt/completion rows of the tiny model's words: 7 in 8 of 2-10 words, every eighth 30-80."""
    from finetune.util import builtin as tiny

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(30, 80) if i % 8 == 7 else rng.randint(2, 10)
        words = [rng.choice(tiny.WORDS) for _ in range(k)]
        cut = max(1, k // 3)
        rows.append({"prompt": "copy: " + " ".join(words[:cut]) + "\n", "completion": " ".join(words[cut:])})
    rng.shuffle(rows)
    return rows


def documents(rows: list[dict]) -> list[dict]:
    """The examples inside packed rows (split where position ids restart)."""
    out = []
    for r in rows:
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
        out += [{"input_ids": r["input_ids"][a:b], "labels": r["labels"][a:b]} for a, b in zip(starts, starts[1:])]
    return out


def _step(model, optimizer, batches, tspec, token_loss_sum) -> tuple[float, int]:
    """One optimizer step over `batches`, accumulated with the loop's normalisation (loss sum over the
    step's trained tokens). Returns (seconds, trained tokens)."""
    from finetune.train.loss import batch_kernels

    t0 = time.perf_counter()
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for b in batches:
        with batch_kernels(b, "cpu", tspec):
            loss, _ = token_loss_sum(model, b, "cpu", tspec)
            (loss / total).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, total


def run() -> dict:
    from finetune.data import batching as B
    from finetune.data import encode as E
    from finetune.recipe import DataSpec, LoraSpec, ModelSpec, QuantizationSpec, TrainSpec
    from finetune.train.lora import apply_lora
    from finetune.train.loss import token_loss_sum
    from finetune.weights.load.model import load_model
    from finetune.weights.load.resolve import load_tokenizer
    from finetune.train.optim import build_optimizer

    mspec, tspec = ModelSpec(gradient_checkpointing=False), TrainSpec(optimizer="adamw_8bit")
    tok = load_tokenizer(mspec)
    examples = [E.encode(r, "prompt_completion", tok, DataSpec()) for r in skewed_rows(N_EXAMPLES)]
    whole = B.batch_stats(examples, BATCH, MAX_LEN)

    rows = B.pack(examples, MAX_LEN)[:TIMED_ROWS]
    same = documents(rows)
    random.Random(0).shuffle(same)  # the padded side sees these examples in a shuffled order, as training does
    packed = [B.collate_packed(rows[i: i + BATCH], tok.pad_token_id) for i in range(0, len(rows), BATCH)]
    padded = [B.collate(same[i: i + BATCH], tok.pad_token_id) for i in range(0, len(same), BATCH)]

    model = apply_lora(load_model(mspec, QuantizationSpec(), quiet=True), LoraSpec(), seed=0)
    model.train()
    optimizer = build_optimizer(model, tspec)
    speeds = {"packed": [], "unpacked": []}
    for rep in range(REPEATS + 1):  # rep 0 warms both paths up and is not counted
        order = [("packed", packed), ("unpacked", padded)]
        for name, batches in order if rep % 2 else order[::-1]:
            secs, trained = _step(model, optimizer, batches, tspec, token_loss_sum)
            if rep:
                speeds[name].append(trained / secs)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    return {
        "packing_speedup": round(med["packed"] / med["unpacked"], 3),
        "trained_tokens_per_s_packed": round(med["packed"], 1),
        "trained_tokens_per_s_unpacked": round(med["unpacked"], 1),
        "padding_fraction_packed": whole["padding_fraction_packed"],
        "padding_fraction_unpacked": whole["padding_fraction_unpacked"],
        "packing_efficiency": whole["packing_efficiency"],
        "timed_padding_fraction_packed": B.padding_fraction(rows, BATCH),
        "timed_padding_fraction_unpacked": B.padding_fraction(same, BATCH),
        "examples": len(examples), "packed_rows": whole["packed_rows"], "timed_examples": len(same),
        "max_len": MAX_LEN, "batch": BATCH, "repeats": REPEATS,
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
