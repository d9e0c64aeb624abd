"""Row 7, `loss_memory`: peak bytes of the loss path (output head + cross-entropy, forward and backward)
on CPU, finetune's chunked loss (train.loss) against full logits, on a synthetic Llama with Llama 3's
vocabulary (128,256) and a few small layers, at 2 x 2048 trained tokens; each beside the planner's
figure for it (finetune.plan.logits).

How it is measured: each path runs in a fresh process (fork) from the model's final hidden states, and
its peak is the growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs
just before) over its resident set before. Every buffer of the loss path is megabytes large, so glibc
serves it with mmap and gives it back on free: resident bytes follow live tensors.
"""
from __future__ import annotations

from benchmarks.common import fork_context, in_fresh_process

VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 128_256, 64, 2, 2, 2048


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _hidden_and_head(precision: str):
    """Final hidden states of the synthetic model (requiring grad, as in training) and its head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state.reshape(BATCH * SEQ, HIDDEN)
    targets = torch.roll(ids, -1, dims=1).reshape(-1)
    # the head is frozen, as in QLoRA training: no [vocab x hidden] gradient
    return hidden.clone().requires_grad_(True), model.lm_head.weight.requires_grad_(False), targets


def measure(path: str, precision: str) -> dict:
    """Peak bytes above the starting resident set of one forward + backward of `path`."""
    import contextlib
    import gc

    import torch
    import torch.nn.functional as F

    from finetune.plan.logits import chunk_rows
    from finetune.train.loss import chunked_head_loss

    hidden, weight, targets = _hidden_and_head(precision)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    with amp:
        if path == "chunked":
            loss = chunked_head_loss(hidden, weight, None, targets, chunk_rows(VOCAB))
        else:
            loss = F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")
    loss.backward()
    return {"peak_bytes": _status("VmHWM") - before, "loss": float(loss.detach())}


def planned(path: str, precision: str) -> int:
    from finetune.plan.logits import chunked_loss_bytes, full_logits_bytes

    cb = 2 if precision == "bf16" else 4
    if path == "chunked":
        return chunked_loss_bytes(BATCH * SEQ, VOCAB, HIDDEN, cb, 0, 4)
    return full_logits_bytes(BATCH * SEQ, VOCAB, cb)


def run(precision: str = "no") -> dict:
    ctx = fork_context()
    got = {p: in_fresh_process(ctx, measure, p, precision) for p in ("chunked", "full")}
    out = {"tokens": BATCH * SEQ, "vocab": VOCAB, "precision": precision}
    for p, m in got.items():
        plan = planned(p, precision)
        out[p] = {"measured_bytes": m["peak_bytes"], "planned_bytes": plan,
                  "plan_error": plan / m["peak_bytes"] - 1, "loss": m["loss"]}
    out["loss_memory_ratio"] = got["full"]["peak_bytes"] / got["chunked"]["peak_bytes"]
    out["same_loss"] = abs(got["full"]["loss"] / got["chunked"]["loss"] - 1) < 1e-3
    return out


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(*sys.argv[1:]), indent=1))
