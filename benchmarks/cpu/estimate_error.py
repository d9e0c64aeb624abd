"""Row 4, `estimate_error`: the memory planner (`finetune estimate`) against bytes measured on the tiny
4-bit + LoRA model: weights, quantization constants, gradients, 8-bit optimizer state, and the tensors
autograd saves for backward over a sweep of sequence length x micro-batch x checkpointing. The row is the
worst relative error over all of them (benchmarks/cpu/memcheck.py does the measuring)."""
from __future__ import annotations


def run() -> dict:
    from benchmarks.cpu.memcheck import measured_vs_planned

    res = measured_vs_planned()
    return {"estimate_error": res["worst_error"], "worst_static_error": res["worst_static_error"],
            "worst_activation_error": res["worst_activation_error"], "rows": res["rows"]}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
