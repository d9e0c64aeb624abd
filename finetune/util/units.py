"""Sizes in bytes: one rule to read them (`--gpu-memory 24GiB`, `--max-shard-size 5GB`) and one to print them."""
from __future__ import annotations

import re

from finetune.util.errors import RecipeError

TiB = 1 << 40
GiB = 1 << 30
MiB = 1 << 20
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt])(i?))?(b?)\s*", re.I)


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from '24GiB', '24G' or '24Gi' (binary: how GPU memory is quoted), '5GB' (decimal: how
    transformers' max_shard_size is quoted), or a bare number of bytes. RecipeError naming `what` otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = _SIZE.fullmatch(str(text))
        if not m:
            raise RecipeError([f"{what}: cannot read a size from {text!r}; use a number with a unit, e.g. 24GiB, "
                               "80GB or 500MB"])
        num, unit, binary, b = float(m.group(1)), (m.group(2) or "").lower(), m.group(3), m.group(4)
        base = 1000 if (b and not binary) else 1024
        size = int(num * base ** (" kmgt".index(unit))) if unit else int(num)
    if size <= 0:
        raise RecipeError([f"{what}: must be positive, got {text!r}"])
    return size


def fmt(n: int | None) -> str:
    """GiB with two decimals from half a GiB up (the unit GPU memory is planned in), MiB below, TiB above
    1 TiB (disks)."""
    if n is None:
        return "?"
    if abs(n) >= TiB:
        return f"{n / TiB:.2f} TiB"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB // 2 else f"{n / MiB:.1f} MiB"
