#!/usr/bin/env bash
# The wheels of the speed_unsloth stage's interpreter path (benchmarks/gpu/speed.py, benchmarks/README.md "The
# speed stage"): unsloth and what it imports that the GPU image (Python 3.12, torch 2.11+cu130, triton 3.6,
# transformers 5.17, accelerate 1.15, tokenizers, huggingface_hub 1.33, pyarrow, pandas, xxhash, httpx, torchvision,
# sentencepiece, protobuf) lacks, at versions unsloth 2026.10.9 accepts: trl <= 1.15, datasets < 5 (and the fsspec
# it allows). bitsandbytes (trimmed), peft, dill, multiprocess and pydantic are the GPU kit's own wheels
# (../shared/gpukit/wheels). Left out: xformers (optional to unsloth; a torch-specific build of 100+ MB, too large
# to travel: unsloth then runs SDPA) and what unsloth only imports for other features (diffusers, hf_transfer,
# msgspec for vLLM). 20 wheels, 43 MB: with the checkout they travel in a device call of their own.
# Usage: bash benchmarks/peers/unsloth_wheels.sh OUT_DIR [KIT_WHEELS_DIR]
set -euo pipefail
out=${1:?OUT_DIR}; kit=${2:-$(dirname "$0")/../../../shared/gpukit/wheels}; mkdir -p "$out"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$out" \
  unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 fsspec==2026.2.0 cut_cross_entropy==25.1.1 \
  torchao==0.18.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0
for n in bitsandbytes peft dill multiprocess pydantic-2 pydantic_core annotated_types typing_inspection typing_extensions; do
  cp "$kit"/$n*.whl "$out"/
done
# Every wheel must install offline under cp312 tags (what the GPU machine's pip does), checked here first.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$(mktemp -d)" --python-version 3.12 \
  --implementation cp --only-binary=:all: $plat "$out"/*.whl
ls "$out" | wc -l; du -sh "$out"
