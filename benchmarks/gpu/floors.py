"""pyproject's dependency floors against what is installed, and against the versions the code was run on.

A floor promises that the code runs on that version. The only versions a run of ours proves are the pins of
constraints.txt (CI and every benchmark) and the GPU image's packages the GPU proof ran on (RAN_ON below,
from benchmarks/RESULTS_GPU.md). `tests/unit/test_floors.py` keeps every floor one of those.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Versions below the pins that a recorded run used: package -> (version, where it ran).
RAN_ON = {"torch": ("2.11.0", "the GPU proof on the GPU image (torch 2.11.0+cu130), benchmarks/RESULTS_GPU.md")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors() -> dict[str, str]:
    """{package: floor} of pyproject's [project] dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    out = {}
    for m in re.finditer(r'"([A-Za-z0-9_.\-]+)>=([0-9][^",;<]*)', block):
        out[_norm(m.group(1))] = m.group(2).strip()
    return out


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, ver = line.split("==", 1)
            out[_norm(name)] = ver.strip()
    return out


def check_floors() -> dict[str, dict]:
    """Each floor beside the installed version: ok when installed >= floor."""
    import importlib.metadata as md

    from packaging.version import Version

    out = {}
    for pkg, floor in floors().items():
        try:
            have = md.version(pkg)
        except md.PackageNotFoundError:
            have = None
        base = have.split("+")[0] if have else None
        out[pkg] = {"floor": floor, "installed": have, "ok": bool(base) and Version(base) >= Version(floor)}
    return out
