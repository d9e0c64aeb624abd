#!/usr/bin/env bash
# Create .venv with the tested, pinned versions (constraints.txt). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and by exact version: an unpinned `pip install torch` pulls a multi-GB CUDA build here.
# --no-compile, then compileall on every core: pip byte-compiles ~18,000 files on one core (about 60 s of a
# 90 s setup); the same .pyc files written in parallel take about 25 s on 2 cores.
python -m pip install -q --no-compile "torch==2.13.0"
python -m pip install -q --no-compile -c constraints.txt -e ".[test]"
# A file some package ships that does not compile (a template, a Python 2 leftover) is left to pip's rule:
# not an error. Only the .pyc files are at stake, and a missing one is compiled on first import.
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python -m compileall -q -j 0 "$site" >/dev/null || true
# llama.cpp's own GGUF converter for `finetune export` (and its tests): the scripts vendored in the pinned
# llama-cpp-python sdist, extracted once into ~/.cache/finetune (a 77 MB download; nothing is compiled).
# Set FINETUNE_SKIP_CONVERTER=1 to skip; export then says how to fetch it.
[ -n "${FINETUNE_SKIP_CONVERTER:-}" ] || python -m finetune.gguf.converter --fetch
