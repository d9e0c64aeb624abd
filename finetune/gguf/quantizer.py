"""llama.cpp's `llama-quantize` for the K-quant GGUF types people serve (Q4_K_M above all), at the pinned release.

The K-quants exist only in llama.cpp's C++ (gguf-py can read them, not write them), and llama.cpp ships no
package of its tools. Where the binary comes from, in order: FINETUNE_LLAMA_QUANTIZE, the cache dir this module
builds into (QUANTIZE_DIR), `llama-quantize` on PATH. `python -m finetune.gguf.quantizer --build` compiles it from
the llama.cpp tree vendored in the same llama-cpp-python sdist the converter comes from (cmake and a C++
compiler; CPU only, about 25 minutes on 2 cores), once. `finetune export --outtype q4_k_m` without it writes the
checked f16 GGUF and prints the command that finishes the job.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from finetune.gguf import converter

KQUANTS = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}  # export's --outtype -> llama-quantize's name
BUILD_COMMAND = "python -m finetune.gguf.quantizer --build"


def quantize_dir() -> Path:
    return converter.converter_dir().parent / f"llama-quantize-{converter.PIN}"


def find() -> str | None:
    """The llama-quantize to run, or None."""
    env = os.environ.get("FINETUNE_LLAMA_QUANTIZE")
    if env:
        return env if Path(env).is_file() and os.access(env, os.X_OK) else None
    built = quantize_dir() / "llama-quantize"
    if built.is_file():
        return str(built)
    return shutil.which("llama-quantize")


def env_problem() -> str | None:
    """Why FINETUNE_LLAMA_QUANTIZE, when set, names no program to run (the variable named, not "not installed")."""
    env = os.environ.get("FINETUNE_LLAMA_QUANTIZE")
    if not env or (Path(env).is_file() and os.access(env, os.X_OK)):
        return None
    what = "is not executable" if Path(env).is_file() else "is a directory" if Path(env).is_dir() else "does not exist"
    return (f"but FINETUNE_LLAMA_QUANTIZE={env!r} {what} (point it at llama.cpp's llama-quantize binary, or unset "
            "it to use the one built here or on PATH)")


def output_problem(binary: str, out: Path) -> str | None:
    """What a llama-quantize that exited 0 produced when it is not a GGUF file: nothing, an empty file, or
    bytes without GGUF's magic (a wrapper script, another tool); None when it starts like a GGUF."""
    try:
        size = out.stat().st_size
        with open(out, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        return f"{binary} exited 0 but wrote no file at {out}"
    if size == 0:
        return f"{binary} exited 0 but wrote an empty file"
    if head != b"GGUF":
        return f"{binary} exited 0 but wrote {size} bytes that are not a GGUF file (they start with {head!r})"
    return None


def command(binary: str, src: Path, out: Path, outtype: str) -> list[str]:
    return [binary, str(src), str(out), KQUANTS[outtype]]


def missing_advice(src: Path, out: Path, outtype: str) -> str:
    """What to run when no llama-quantize is found: build it (or install llama.cpp), then quantize."""
    quoted = " ".join(command("llama-quantize", src, out, outtype))
    why = env_problem() or "which is not installed"  # the variable named when it points nowhere
    return (f"{KQUANTS[outtype]} needs llama.cpp's llama-quantize, {why}. Build it once from the "
            f"pinned llama.cpp sources ({BUILD_COMMAND}: cmake and a C++ compiler, about 25 minutes on 2 cores) "
            f"and re-run this export, or with llama.cpp's tools on PATH run: {quoted}")


def quantize(binary: str, src: Path, out: Path, outtype: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(binary, src, out, outtype), capture_output=True, text=True, check=False)


def build(jobs: int | None = None) -> Path:
    """Download the pinned sdist, compile llama-quantize (CPU, static), install it into quantize_dir()."""
    target = quantize_dir()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"error: building llama-quantize needs {tool}, which is not on PATH")
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="llama-quantize-") as tmp:
        print(f"downloading llama-cpp-python=={converter.PIN}'s sdist (llama.cpp's sources)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, f"llama-cpp-python=={converter.PIN}"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        options = ["-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                   "-DCMAKE_BUILD_TYPE=Release"]
        print(f"configuring and compiling llama-quantize with {jobs} jobs (cmake's progress follows)", flush=True)
        subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *options], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-quantize", "-j", str(jobs)],
                       check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        shutil.copy2(src / "build" / "bin" / "llama-quantize", staged / "llama-quantize")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staged, target)
    return target / "llama-quantize"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m finetune.gguf.quantizer", description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help=f"compile llama-quantize into {quantize_dir()}")
    ap.add_argument("--jobs", type=int, help="parallel compile jobs (default: every core)")
    a = ap.parse_args(argv)
    if a.build:
        print(f"built {build(a.jobs)}")
        return 0
    found = find()
    print(found or f"no llama-quantize found; {BUILD_COMMAND} builds one")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
