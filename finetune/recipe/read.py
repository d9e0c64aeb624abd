"""Recipe loading: YAML -> dict -> key=value overrides -> validated `Recipe`, with every error at once.

Each problem carries its dotted path (``lora.r``) and, for misspelt keys, a did-you-mean.
"""
from __future__ import annotations

import difflib
import os
import re
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.recipe.schema import Recipe
from finetune.util.errors import RecipeError


def _suggest(word: str, candidates) -> str:
    match = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _model_at(path: tuple) -> type[BaseModel] | None:
    """The pydantic section class found at a dotted path, to list valid keys for suggestions."""
    cls: Any = Recipe
    for part in path:
        if isinstance(part, int):
            continue
        fld = getattr(cls, "model_fields", {}).get(part)
        if fld is None:
            return None
        ann = fld.annotation
        inner = getattr(ann, "__args__", None)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        elif inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            cls = inner[0]
        else:
            return None
    return cls


def _format_errors(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(x for x in e["loc"] if x not in ("function-after[_contract()]",))
        dotted = ".".join(str(x) for x in loc)
        kind = e["type"]
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1])
            known = list(parent.model_fields) if parent else []
            where = ".".join(str(x) for x in loc[:-1]) or "top level"
            what = "section" if len(loc) == 1 else "key"
            out.append(f"{dotted}: unknown {what}{_suggest(loc[-1], known)}; valid keys in {where}: "
                       f"{', '.join(known)}")
        elif kind == "value_error" and e.get("ctx", {}).get("error") and not loc:
            out.extend(str(e["ctx"]["error"]).splitlines())
        else:
            msg = e["msg"]
            got = e.get("input")
            shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
            out.append(f"{dotted or 'recipe'}: {msg}{shown}")
    # Literal unions report one line per alternative; keep the first per path.
    seen, dedup = set(), []
    for line in out:
        key = line.split(":", 1)[0]
        if key in seen and "unknown" not in line:
            continue
        seen.add(key)
        dedup.append(line)
    return dedup


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError([f"override '{text}': expected key=value, e.g. train.max_steps=5"])
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise RecipeError([f"override '{text}': empty key"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError):  # not YAML (or nested past the parser's limit): a plain string
        value = raw
    if isinstance(value, str) and any(c in raw for c in "\r\n") and value != raw.strip():
        # YAML folds a plain scalar's line breaks into spaces ("a\nb" -> "a b"): a multi-line value (a chat
        # template, a system prompt) is kept as typed instead of changed silently.
        value = raw
    return key.split("."), value


def _set(node: dict, key: str, value):
    """A mapping given for a section (`train={max_steps: 5}`) changes the keys it names and keeps the
    section's others, exactly like `train.max_steps=5`; replacing the section would silently reset every key
    the recipe set in it to its default."""
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        for k, v in value.items():
            _set(node[key], k, v)
    else:
        node[key] = value


_INDEXED = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")


def _steps(parts: list[str]) -> list[str | int] | None:
    """`["data", "sources[0]", "format"]` -> `["data", "sources", 0, "format"]` (the syntax the errors print);
    None when a part's brackets are not `[N]`."""
    out: list[str | int] = []
    for part in parts:
        m = _INDEXED.match(part)
        if not m:
            return None
        out.append(m.group(1))
        out += [int(i) for i in re.findall(r"\d+", m.group(2))]
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    problems = []
    for text in overrides:
        try:
            parts, value = parse_override(text)
        except RecipeError as e:
            problems += e.problems
            continue
        problem = _apply(data, text, _steps(parts), value)
        if problem:
            problems.append(problem)
    if problems:
        raise RecipeError(problems, "command line")
    return data


def _apply(data: dict, text: str, steps: list | None, value) -> str | None:
    """Set one override; the problem as a line when its key does not lead anywhere."""
    if steps is None:
        return f"override '{text}': a list entry is written key[N], e.g. data.sources[0].format=messages"
    node, done = data, []
    for step in steps[:-1]:
        if isinstance(step, int):
            if not isinstance(node, list) or not step < len(node):
                n = len(node) if isinstance(node, list) else 0
                size = f"has {n} entr{'y' if n == 1 else 'ies'}" if isinstance(node, list) else "is not a list"
                return f"override '{text}': {'.'.join(done)} {size}"
            node = node[step]
            done[-1] += f"[{step}]"
            continue
        if not isinstance(node, dict) or not isinstance(node.get(step, {}), (dict, list)):
            return f"override '{text}': {step} is not a section"
        node = node.setdefault(step, {})
        done.append(step)
    if isinstance(steps[-1], int):
        if not isinstance(node, list) or not steps[-1] < len(node):
            return f"override '{text}': {'.'.join(done)} has no entry {steps[-1]}"
        node[steps[-1]] = value
    elif isinstance(node, dict):
        _set(node, steps[-1], value)
    else:
        return f"override '{text}': {'.'.join(done)} is a list: name an entry, e.g. {'.'.join(done)}[0]"
    return None


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few KiB; a bigger file is not one (and /dev/zero never ends)


def _read_text(p: Path) -> str:
    """The recipe's text: a regular file (a FIFO or a device would block or never end) of at most 1 MiB."""
    if not p.exists():
        raise RecipeError([f"no such file: {p}"], str(p))
    if p.is_dir():
        raise RecipeError([f"{p} is a directory, expected a recipe YAML file"], str(p))
    if not p.is_file():
        raise RecipeError([f"{p} is not a regular file (a pipe or a device?), expected a recipe YAML file"], str(p))
    with open(p, "rb") as f:
        raw = f.read(MAX_RECIPE_BYTES + 1)
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError([f"larger than {MAX_RECIPE_BYTES >> 20} MiB: not a recipe YAML file"], str(p))
    return raw.decode("utf-8")


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        text = _read_text(p)
    except UnicodeDecodeError as e:
        raise RecipeError([f"not UTF-8 text (byte {e.start})"], str(p)) from None
    except OSError as e:
        raise RecipeError([f"cannot read: {e.strerror}"], str(p)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError([f"{where}invalid YAML: {reason}"], str(p)) from None
    except RecursionError:  # PyYAML parses recursively: thousands of nested brackets exhaust the stack
        raise RecipeError(["invalid YAML: nested too deeply"], str(p)) from None
    if data is None:
        raise RecipeError(["the file is empty; a recipe needs at least one section, e.g. `model:`"], str(p))
    if not isinstance(data, dict):
        raise RecipeError([f"top level must be a mapping of sections, got {type(data).__name__}"], str(p))
    return data


def resolve_auto_strategy(data: dict, world: int | None = None) -> bool:
    """`distributed.strategy: auto` (the default) -> single for one process, fsdp for several, in `data`
    (its `distributed` section is replaced by a resolved copy);
    True when it was auto. The count: distributed.num_processes, else `world`, else the launcher's
    WORLD_SIZE, else distributed.num_machines (1 when not launched)."""
    dist = data.get("distributed")
    if dist is None:
        dist = {}
    if not isinstance(dist, dict) or dist.get("strategy", "auto") != "auto":
        return False
    dist = data["distributed"] = dict(dist)  # a copy: the caller's dict is left as it was
    try:
        n = int(dist.get("num_processes") or world or os.environ.get("WORLD_SIZE") or dist.get("num_machines") or 1)
    except (TypeError, ValueError):
        return False  # a bad num_processes is reported by validation
    dist["strategy"] = "fsdp" if n > 1 else "single"
    return True


# Keys that once existed and did nothing: the streaming loader always reads the checkpoint once per machine
# and sends each rank only its part, and checkpoints always hold the gathered adapter and each rank's
# optimizer state. A recipe that sets one is told so by name; a run dir's recipe.yaml written before they
# went (where they are only the defaults written out) loads without them.
REMOVED = {
    ("model", "low_cpu_mem_usage"): "the streaming loader always reads one tensor at a time",
    ("fsdp", "cpu_ram_efficient_loading"): "the streaming loader always reads the checkpoint once per machine and "
                                           "sends each rank only its shard",
    ("fsdp", "sync_module_states"): "every rank receives its shard from the machine's reader; nothing is broadcast "
                                    "at wrap time",
    ("fsdp", "state_dict_type"): "checkpoints always hold the adapter gathered to full shapes and each rank's "
                                 "optimizer state",
}


def removed_keys(data: dict, quiet: bool = False) -> dict:
    """`data` without the REMOVED keys; RecipeError naming each one it sets unless `quiet`."""
    found = [(sec, key) for sec, key in REMOVED if isinstance(data.get(sec), dict) and key in data[sec]]
    if found and not quiet:
        raise RecipeError([f"{sec}.{key}: this setting was removed: {REMOVED[sec, key]}. Fix: delete it from the "
                           "recipe" for sec, key in found])
    data = dict(data)
    for sec, key in found:
        data[sec] = {k: v for k, v in data[sec].items() if k != key}
    return data


def from_dict(data: dict, source: str | None = None, world: int | None = None, old_keys_ok: bool = False) -> Recipe:
    """Validate a recipe dict; `world` is the process count `strategy: auto` is resolved for (see
    resolve_auto_strategy). `old_keys_ok`: drop REMOVED keys instead of refusing them (a run dir's recipe)."""
    try:
        if isinstance(data, dict):
            data = removed_keys(data, quiet=old_keys_ok)
            auto = resolve_auto_strategy(data, world)
            r = Recipe.model_validate(data)
            r.distributed._from_auto = auto
            return r
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e), source) from None
    except (TypeError, ValueError) as e:  # e.g. non-string keys
        raise RecipeError([str(e)], source) from None


def load(path: str | os.PathLike, overrides: list[str] | None = None, world: int | None = None,
         old_keys_ok: bool = False) -> Recipe:
    """Read, override and validate a recipe. Raises RecipeError with every problem at once. `world`: the
    process count to plan for when it is not the launcher's (`--gpus`); `old_keys_ok`: see from_dict."""
    data = read_yaml(path)
    data = apply_overrides(data, list(overrides or []))
    return from_dict(data, str(path), world, old_keys_ok)




def field_docs(cls: type[BaseModel] = Recipe, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field, for the generated recipe reference."""
    rows = []
    for name, fld in cls.model_fields.items():
        ann = fld.annotation
        key = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += field_docs(ann, key + ".")
            continue
        default = fld.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        elif isinstance(default, list):
            default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
        rows.append((key, repr(default) if not isinstance(default, Enum) else default.value,
                     " ".join((fld.description or "").split())))
    return rows
