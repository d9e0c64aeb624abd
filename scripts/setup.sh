#!/usr/bin/env bash
# Create .venv with the tested, pinned versions (constraints.txt). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and by exact version: an unpinned `pip install torch` pulls a multi-GB CUDA build here.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -c constraints.txt -e ".[test]"
# llama.cpp's own GGUF converter for `finetune export` (and its tests): the scripts vendored in the pinned
# llama-cpp-python sdist, extracted once into ~/.cache/finetune (a 77 MB download; nothing is compiled).
# Set FINETUNE_SKIP_CONVERTER=1 to skip; export then says how to fetch it.
[ -n "${FINETUNE_SKIP_CONVERTER:-}" ] || python -m finetune.gguf.converter --fetch
