"""Side-by-side performance measurements, one command: `python -m benchmarks [--json]`.

One module per row (throughput, packing, merge_rss, estimate_error, checkpointing, startup, trl_sft,
loss_memory), each exposing `run(**settings) -> dict`; `__main__` runs each in a fresh interpreter and writes
benchmarks/RESULTS.md.
`benchmarks/gpu.py` is the GPU-machine counterpart (a real recipe, tokens/s, MFU, peak memory per GPU).
"""
