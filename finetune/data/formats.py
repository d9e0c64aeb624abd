"""Row formats: telling a row's format from its fields, checking a row against a format, and collecting
the rows that fail.

A bad row (broken JSON, bad bytes, missing field, wrong type, empty text, a line over the readers'
MAX_ROW_BYTES, a tool call whose arguments are not a JSON object) goes to `BadRows`: with `on_bad_row: error`
the run stops with every bad row found (exit 2, no traceback), with `skip` it is counted and the first few
are reported.
"""
from __future__ import annotations

import json
import re

from finetune.util.errors import RecipeError

# A value quoted in a message about a row that parsed as its declared format: escaped (ascii) and cut here, so
# a message never carries a file's text at length or a control character to the terminal.
EXCERPT = 40
# What a field name looks like; anything else among a row's keys is a line of a file that is not a table.
FIELD_NAME = re.compile(r"[A-Za-z_][\w .-]{0,63}")


def excerpt(value) -> str:
    """`value` quoted for a message: escaped (ascii()), at most EXCERPT characters, then '...'."""
    text = ascii(value)
    return text if len(text) <= EXCERPT else text[:EXCERPT] + "..."


def field_names(row: dict) -> str:
    """A row's keys for a message: the ones that look like field names, escaped; the rest only counted (the
    header 'line' of a file that is not a CSV file is one key holding that line)."""
    keys = sorted(k for k in row if k != "_where")
    names = [k for k in keys if isinstance(k, str) and FIELD_NAME.fullmatch(k)]
    shown = ", ".join(excerpt(k) for k in names[:8]) + (", ..." if len(names) > 8 else "")
    others = len(keys) - len(names)
    if not names:
        return f"no field names ({others} key(s) that are not names)" if keys else "no fields"
    return f"the fields [{shown}]" + (f" and {others} key(s) that are not names" if others else "")


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
            raise RecipeError(self.first(self.SHOW), total=len(self.items),
                              notes=("(set data.on_bad_row: skip to skip bad rows and report them)",))

    def first(self, n: int) -> list[str]:
        """The first n bad rows in file and line order (encoding sees rows shuffled; a reader does not)."""
        return sorted(self.items, key=where_key)[:n]

    def __len__(self):
        return len(self.items)


def where_key(item: str) -> tuple:
    """Sort key of "file.jsonl:7: why" or "file.parquet row 12: why": the file, then the line as a number."""
    head = item.split(": ", 1)[0]
    m = re.match(r"(.*?)(?::| row )(\d+)$", head)
    return (m.group(1), int(m.group(2))) if m else (head, 0)


def detect_format(row: dict) -> str | None:
    if "input_ids" in row:
        return "tokens"
    if "chosen" in row and "rejected" in row:
        return "preference"
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


# --------------------------------------------------------------------------- chat messages (OpenAI format)

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # the names transformers aliases to each other


def content_text(content) -> str | None:
    """A message's text: a string as is, a list of text parts joined by newlines (as vLLM joins them for
    templates that take a string), None when there is none."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content)
    return content


def _content(v, where: str, optional: bool) -> str | None:
    if v is None:
        return None if optional else f"{where} must be a string, got NoneType"
    if isinstance(v, str):
        return None
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type", "text") == "text"
                                   and isinstance(p.get("text"), str) for p in v):
        return None
    return f"{where} must be a string or a list of text parts ({{\"type\": \"text\", \"text\": ...}}), " \
           f"got {type(v).__name__}" + (" holding other parts" if isinstance(v, list) else "")


def parse_json_field(v, want: type):
    """A value that may arrive as JSON text (tool arguments in OpenAI's format, a `tools` column in parquet or
    CSV) as the object it encodes; ValueError when it is not JSON or not a `want`."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not valid JSON ({e.msg}, column {e.colno})") from None
        except (ValueError, RecursionError):  # a number of over 4300 digits, or nesting past the stack
            raise ValueError("is not usable JSON (nested too deeply, or a number too long)") from None
    if not isinstance(v, want):
        raise ValueError(f"must be a JSON {'object' if want is dict else 'array'}, got {type(v).__name__}")
    return v


def _function(item, where: str) -> tuple[dict | None, str | None]:
    """The {name, arguments|parameters} object of a tool call or a tool: OpenAI's {"type": "function",
    "function": {...}}, or the function object itself."""
    if not isinstance(item, dict):
        return None, f"{where} must be an object, got {type(item).__name__}"
    fn = item.get("function", item)
    if not isinstance(fn, dict):
        return None, f"{where}.function must be an object, got {type(fn).__name__}"
    if not isinstance(fn.get("name"), str) or not fn["name"].strip():
        return None, f"{where}.function.name must be a non-empty string"
    return fn, None


def _tool_calls(calls, where: str) -> str | None:
    if not isinstance(calls, list):
        return f"{where} must be a list, got {type(calls).__name__}"
    for j, call in enumerate(calls):
        fn, why = _function(call, f"{where}[{j}]")
        if why:
            return why
        if fn.get("arguments") is not None:
            try:
                parse_json_field(fn["arguments"], dict)
            except ValueError as e:
                return f"{where}[{j}].function.arguments {e}"
    return None


def check_tools(row: dict) -> str | None:
    """Why the row's `tools` (the functions the chat template lists for the model) are unusable."""
    if row.get("tools") is None:
        return None
    try:
        tools = parse_json_field(row["tools"], list)
    except ValueError as e:
        return f"field 'tools' {e}"
    for j, tool in enumerate(tools):
        why = _function(tool, f"tools[{j}]")[1]
        if why:
            return why
    return None


def _message(m, where: str, role_key: str, content_key: str, roles) -> str | None:
    if not isinstance(m, dict):
        return f"{where} must be an object, got {type(m).__name__}"
    if not isinstance(m.get(role_key), str) or m[role_key] not in roles:
        return f"{where}.{role_key} must be one of {sorted(roles)}, got {excerpt(m.get(role_key))}"
    role, calls = SHAREGPT_ROLES[m[role_key]], m.get("tool_calls")
    calls = calls if role == "assistant" and calls else None  # an empty list or null: no calls
    why = _content(m.get(content_key), f"{where}.{content_key}", optional=calls is not None)
    if not why and calls is not None:
        why = _tool_calls(calls, f"{where}.tool_calls")
    if why:
        return why
    # An assistant turn with nothing in it would train the model to answer with nothing, as an empty
    # completion or output would in the other formats.
    if role == "assistant" and calls is None and not content_text(m[content_key]).strip():
        return f"{where}.{content_key} is empty (an assistant turn)"
    for key in REASONING_KEYS + (("tool_call_id", "name") if role == "tool" else ()):
        if m.get(key) is not None and not isinstance(m[key], str):
            return f"{where}.{key} must be a string, got {type(m[key]).__name__}"
    return None


def _chat(msgs, key: str, role_key="role", content_key="content", roles=CHAT_ROLES) -> str | None:
    """Why a list of chat messages is unusable: OpenAI's message format, with tool calls (content may then be
    null), tool results and reasoning."""
    if not isinstance(msgs, list):
        return f"field '{key}' must be a list of messages, got {type(msgs).__name__}"
    if not msgs:
        return f"field '{key}' is empty"
    for i, m in enumerate(msgs):
        why = _message(m, f"{key}[{i}]", role_key, content_key, roles)
        if why:
            return why
    return None


def _token_list(row: dict, key: str, allow_ignore: bool) -> str | None:
    v = row.get(key)
    if not isinstance(v, list) or not v:
        return f"field '{key}' must be a non-empty list of token ids, got {type(v).__name__}"
    for i, t in enumerate(v):
        # Ids are cached as int32 (prepare._features): no vocabulary comes near 2**31.
        if type(t) is not int or t >= 1 << 31 or (t < 0 and not (allow_ignore and t == -100)):
            return f"{key}[{i}] must be a token id (an integer >= 0{' or -100' if allow_ignore else ''}), got {excerpt(t)}"
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


def _preference(row: dict) -> str | None:
    """Preference pairs: `prompt`, `chosen` and `rejected` strings; or chats: `chosen` and `rejected` message
    lists after a shared `prompt` list, or (no `prompt`) whole chats that share every message but their last."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if isinstance(chosen, str) or isinstance(rejected, str):
        return _text(row, "prompt", allow_empty=True) or _text(row, "chosen") or _text(row, "rejected")
    why = (_chat(chosen, "chosen") or _chat(rejected, "rejected") or check_tools(row)
           or (_chat(row["prompt"], "prompt") if row.get("prompt") is not None else None))
    if why:
        return why
    for key, msgs in (("chosen", chosen), ("rejected", rejected)):
        if SHAREGPT_ROLES[msgs[-1]["role"]] != "assistant":
            return f"field '{key}' must end with an assistant turn"
    if row.get("prompt") is None and chosen[:-1] != rejected[:-1]:
        return "'chosen' and 'rejected' must share every message but their last (or give the shared 'prompt')"
    return None


def check_row(row: dict, fmt: str) -> str | None:
    """Why `row` cannot be used as `fmt`, or None when it can."""
    if fmt == "tokens":
        return _tokens(row)
    if fmt == "text":
        return _text(row, "text")
    if fmt == "preference":
        return _preference(row)
    if fmt == "prompt_completion":
        if isinstance(row.get("prompt"), list):  # conversational prompt/completion (TRL's layout)
            return _chat(row["prompt"], "prompt") or _chat(row.get("completion"), "completion") or check_tools(row)
        return _text(row, "prompt", allow_empty=True) or _text(row, "completion")
    if fmt == "instruction":
        return _text(row, "instruction") or _text(row, "input", required=False, allow_empty=True) \
            or _text(row, "output")
    if fmt == "messages":
        if "messages" not in row:
            return "missing field 'messages'"
        return _chat(row["messages"], "messages") or check_tools(row)
    if fmt == "sharegpt":
        if "conversations" not in row:
            return "missing field 'conversations'"
        return _chat(row["conversations"], "conversations", "from", "value", set(SHAREGPT_ROLES)) or check_tools(row)
    return f"unknown format {fmt}"
