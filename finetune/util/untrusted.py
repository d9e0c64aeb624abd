"""One guard for the files finetune reads that a user or another process could have written: adapters and
checkpoint files in a run dir, model configs. Each check returns why the file cannot be used (None when it
can), cheaply and without trusting it: a safetensors header is parsed by hand (sizes first) before any
library maps the file, a torch file is loaded with the weights-only unpickler, which runs no code.

Callers turn a reason into their own refusal (exit 2 naming the file and the fix) or, for checkpoints, set
the checkpoint aside and resume from an older one. The libraries' own errors for these files are tracebacks
(`SafetensorError: header too small`, `UnpicklingError: Weights only load failed`).
"""
from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

# safetensors' own limit on the JSON header (100 MB): a larger length is a damaged or hostile file.
MAX_HEADER = 100 * 1024 * 1024


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file: missing, not a regular file, shorter than its header
    says, a header that is not a JSON object of tensors, or tensor data past the end of the file."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return "not a regular file"
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                return f"{size} bytes, too short for a safetensors file (empty or truncated)"
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER, size - 8):
                return f"its header claims {n} bytes, the file has {size} (truncated or not safetensors)"
            header = json.loads(f.read(n))
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not JSON (damaged or not safetensors)"
    if not isinstance(header, dict):
        return "its header is not a JSON object (damaged or not safetensors)"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name!r} has no valid data_offsets (damaged)"
        end = max(end, offsets[1])
    if end > size - 8 - n:
        return f"its tensors need {end} bytes of data, the file holds {size - 8 - n} (truncated)"
    return None


def weights_only_problem(path: Path) -> str | None:
    """Why `path` is not a torch file the weights-only unpickler accepts (a pickle that would run code, a
    truncated zip, anything else); None when it loads."""
    import torch

    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        return "missing"
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for bad files
        kind = "it is not weights-only (a pickle that could run code)" if "eights only" in str(e) else \
            f"it cannot be loaded ({type(e).__name__})"
        return kind
    return None


def json_object_problem(path: Path) -> str | None:
    """Why `path` is not a JSON object (missing, empty, truncated, not UTF-8, another JSON value), or None."""
    try:
        value = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except (ValueError, UnicodeDecodeError) as e:
        empty = isinstance(e, json.JSONDecodeError) and not e.doc.strip()
        return "empty" if empty else "not valid JSON (truncated or damaged)"
    return None if isinstance(value, dict) else f"holds a JSON {type(value).__name__}, not an object (damaged)"


def adapter_problem(adapter_dir: Path) -> str | None:
    """One line naming the adapter file that cannot be used (adapter_config.json, then the weights) and the
    fix, or None."""
    cfg = Path(adapter_dir) / "adapter_config.json"
    why, f = json_object_problem(cfg), cfg
    if why is None:
        f = Path(adapter_dir) / "adapter_model.safetensors"
        why = safetensors_problem(f)
    if why is None:
        return None
    return (f"{f}: {why}; the adapter is damaged: restore it from the newest checkpoint "
            f"(cp RUN/checkpoints/step-N/adapter/* {adapter_dir}/) or re-run the training")


def remote_code_problem(model_dir: Path, allowed: bool = False) -> str | None:
    """A model dir whose config.json maps to its own Python classes (`auto_map`) runs that code when
    transformers loads it; refused unless `allowed` (model.trust_remote_code)."""
    cfg = Path(model_dir) / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None  # no config to judge: the loader reports a missing or broken one itself
    if allowed or not isinstance(data, dict) or not data.get("auto_map"):
        return None
    return (f"{cfg}: asks for the model's own Python code (auto_map: {', '.join(sorted(map(str, data['auto_map'])))}),"
            " which finetune does not run; remove auto_map (when transformers implements its model_type) or set "
            "model.trust_remote_code: true in the recipe after reading that code")
