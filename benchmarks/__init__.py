"""Measurements of finetune: the CPU rows (`python -m benchmarks`, cpu/), the GPU proof (gpu/) and the
comparisons with other tools (peers/). benchmarks/README.md is the one table of what each measures, its
command, its goal and where its result goes; common.py and flops.py are what the folders share."""
