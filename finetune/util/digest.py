"""File digests for checkpoint manifests and merge records."""
from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The file's SHA-256, read in 1 MiB blocks. Not hashlib.file_digest: that needs Python 3.11, and 3.10 is
    supported (pyproject); a checkpoint save after a whole training run must not crash there."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
