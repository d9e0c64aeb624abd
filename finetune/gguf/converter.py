"""llama.cpp's own GGUF converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py and the gguf-py package they
import), at a pinned release, brought in from PyPI and run unchanged.

Where they come from: llama.cpp publishes no package of its converter; the llama-cpp-python sdist on PyPI vendors
the whole llama.cpp tree at a fixed commit. `fetch()` downloads that sdist with pip (`pip download --no-deps
--no-binary :all: llama-cpp-python==PIN`) and extracts the converter scripts, their `conversion/` package and the
matching `gguf-py` into a cache dir (CONVERTER_DIR). scripts/setup.sh does this once; `finetune export` never
downloads, and says how to fetch when the dir is missing. The vendored gguf-py is the one the converter itself
puts on sys.path (it prefers it to an installed `gguf`), so writer and converter always match; the export check
reads the result with the same package.

Run through `finetune.gguf.llama_shim`, which only registers pre-tokenizers the converter does not know (see
there) and then runs the script as `__main__`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from finetune.util.errors import RecipeError

PIN = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp converter we run (constraints.txt)
MEMBERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/")
FETCH_COMMAND = "python -m finetune.gguf.converter --fetch"


def converter_dir() -> Path:
    """FINETUNE_LLAMA_CPP_CONVERTER, else ~/.cache/finetune/llama-cpp-converter-PIN."""
    env = os.environ.get("FINETUNE_LLAMA_CPP_CONVERTER")
    if env:
        return Path(env).expanduser()
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "finetune"
    return root / f"llama-cpp-converter-{PIN}"


def require() -> Path:
    """The converter dir, or exit 2 (RecipeError) with the command that fetches it."""
    d = converter_dir()
    if not (d / "convert_hf_to_gguf.py").is_file() or not (d / "gguf-py" / "gguf").is_dir():
        raise RecipeError([f"llama.cpp's converter (from llama-cpp-python=={PIN}'s sdist) is not in {d}; fetch it "
                           f"once with `{FETCH_COMMAND}` (scripts/setup.sh does this)"], "export")
    return d


def _extract(sdist: Path, out: Path) -> None:
    prefix = f"llama_cpp_python-{PIN}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if rel and any(rel == want or rel.startswith(want) for want in MEMBERS) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        tar.extractall(out, members=members, filter="data")


def fetch(force: bool = False) -> Path:
    """Download the pinned sdist with pip and extract the converter into converter_dir() (atomically)."""
    final = converter_dir()
    if (final / "convert_hf_to_gguf.py").is_file() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={PIN}", "-d", tmp]
        subprocess.run(cmd, check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        staged = Path(tmp) / "converter"
        _extract(sdist, staged)
        if not (staged / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"{sdist.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
        shutil.rmtree(final, ignore_errors=True)
        staged.rename(final)
    return final


def run_converter(script: str, args: list[str], pre_tokenizers: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `script` (convert_hf_to_gguf.py or convert_lora_to_gguf.py) with `args` in a child Python, with
    `pre_tokenizers` (chkhsh -> llama.cpp pre-tokenizer name) registered first. Output captured."""
    import json

    d = require()
    cmd = [sys.executable, "-m", "finetune.gguf.llama_shim", str(d / script), json.dumps(pre_tokenizers), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _package_root() -> str:
    """The directory holding this `finetune` package, so the child imports the same code."""
    return str(Path(__file__).resolve().parents[2])


if __name__ == "__main__":
    if sys.argv[1:] not in (["--fetch"], ["--fetch", "--force"]):
        sys.exit(f"usage: {FETCH_COMMAND} [--force]")
    print(fetch(force="--force" in sys.argv))
