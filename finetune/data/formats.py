"""Row formats: telling a row's format from its fields, checking a row against a format, and collecting
the rows that fail.

A bad row (broken JSON, bad bytes, missing field, wrong type, empty text, a line over the readers'
MAX_ROW_BYTES) goes to `BadRows`: with `on_bad_row: error` the run stops with every bad row found
(exit 2, no traceback), with `skip` it is counted and the first few are reported.
"""
from __future__ import annotations

from finetune.util.errors import RecipeError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool"}
CHAT_ROLES = {"system", "user", "assistant", "tool"}


class BadRows:
    """Collects bad rows; `check()` raises them all (error mode) once a stage is done."""

    SHOW = 5

    def __init__(self, mode: str):
        self.mode, self.items = mode, []

    def add(self, where: str, why: str):
        self.items.append(f"{where}: {why}")

    def check(self):
        if self.mode == "error" and self.items:
            more = len(self.items) - self.SHOW
            tail = [f"... and {more} more bad rows"] if more > 0 else []
            raise RecipeError(self.items[: self.SHOW] + tail
                              + ["(set data.on_bad_row: skip to skip bad rows and report them)"])

    def __len__(self):
        return len(self.items)


def detect_format(row: dict) -> str | None:
    if "input_ids" in row:
        return "tokens"
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "instruction" in row and "output" in row:
        return "instruction"
    if "text" in row:
        return "text"
    return None


def _text(row: dict, key: str, required=True, allow_empty=False) -> str | None:
    if key not in row or row[key] is None:
        return f"missing field '{key}'" if required else None
    v = row[key]
    if not isinstance(v, str):
        return f"field '{key}' must be a string, got {type(v).__name__}"
    if not allow_empty and not v.strip():
        return f"field '{key}' is empty"
    return None


def _chat(msgs, key: str, role_key="role", content_key="content", roles=CHAT_ROLES) -> str | None:
    """Why a list of chat messages is unusable. An assistant turn with no text is bad, as an empty
    completion or output is in the other formats: it would train the model to answer with nothing."""
    if not isinstance(msgs, list):
        return f"field '{key}' must be a list of messages, got {type(msgs).__name__}"
    if not msgs:
        return f"field '{key}' is empty"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"{key}[{i}] must be an object, got {type(m).__name__}"
        if m.get(role_key) not in roles:
            return f"{key}[{i}].{role_key} must be one of {sorted(roles)}, got {m.get(role_key)!r}"
        if not isinstance(m.get(content_key), str):
            return f"{key}[{i}].{content_key} must be a string, got {type(m.get(content_key)).__name__}"
        if SHAREGPT_ROLES.get(m[role_key]) == "assistant" and not m[content_key].strip():
            return f"{key}[{i}].{content_key} is empty (an assistant turn)"
    return None


def _token_list(row: dict, key: str, allow_ignore: bool) -> str | None:
    v = row.get(key)
    if not isinstance(v, list) or not v:
        return f"field '{key}' must be a non-empty list of token ids, got {type(v).__name__}"
    for i, t in enumerate(v):
        if type(t) is not int or (t < 0 and not (allow_ignore and t == -100)):
            return f"{key}[{i}] must be a token id (an integer >= 0{' or -100' if allow_ignore else ''}), got {t!r}"
    return None


def _tokens(row: dict) -> str | None:
    """Pre-tokenized rows: `input_ids`, and optionally `labels` of the same length (-100: not trained)."""
    why = _token_list(row, "input_ids", allow_ignore=False)
    if why or row.get("labels") is None:
        return why
    why = _token_list(row, "labels", allow_ignore=True)
    if not why and len(row["labels"]) != len(row["input_ids"]):
        why = f"field 'labels' has {len(row['labels'])} entries, 'input_ids' {len(row['input_ids'])}"
    return why


def check_row(row: dict, fmt: str) -> str | None:
    """Why `row` cannot be used as `fmt`, or None when it can."""
    if fmt == "tokens":
        return _tokens(row)
    if fmt == "text":
        return _text(row, "text")
    if fmt == "prompt_completion":
        if isinstance(row.get("prompt"), list):  # conversational prompt/completion (TRL's layout)
            return _chat(row["prompt"], "prompt") or _chat(row.get("completion"), "completion")
        return _text(row, "prompt", allow_empty=True) or _text(row, "completion")
    if fmt == "instruction":
        return _text(row, "instruction") or _text(row, "input", required=False, allow_empty=True) \
            or _text(row, "output")
    if fmt == "messages":
        return _chat(row.get("messages"), "messages") if "messages" in row else "missing field 'messages'"
    if fmt == "sharegpt":
        if "conversations" not in row:
            return "missing field 'conversations'"
        return _chat(row["conversations"], "conversations", "from", "value", set(SHAREGPT_ROLES))
    return f"unknown format {fmt}"
