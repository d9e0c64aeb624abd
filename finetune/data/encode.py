"""Encoding one row: {"input_ids": [...], "labels": [...]} where labels are -100 (IGNORE) on tokens that do
not train (prompts, user turns, templates' headers) so the loss covers exactly the completion / assistant
spans. Prompt/completion and instruction rows are tokenized in two parts; chats are rendered with the
recipe's or the tokenizer's chat template (chat.py: tools, tool calls, reasoning, templates that rewrite
history); text rows train on every token.
"""
from __future__ import annotations

from finetune.data.chat import IGNORE, chat_examples
from finetune.data.formats import REASONING_KEYS, SHAREGPT_ROLES, detect_format
from finetune.recipe import DataSpec
from finetune.util.errors import RecipeError

ENCODER_VERSION = 6  # part of the cache key: bump when encode() changes what it produces
# Text is cut to max_seq_len x this many characters before it is tokenized (bounded time and memory per row,
# whatever the row's size). Tokens average about 4 characters; a piece cut here still makes far more tokens
# than max_seq_len, so the first max_seq_len tokens, and whether the row is too long, stay exactly the same.
# Should a cut piece make fewer (runs of 32+ characters per token), it is tokenized whole instead.
CHARS_PER_TOKEN_CAP = 32

# ChatML, for tokenizers without a template of their own (`data.chat_template: chatml`).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_template(spec: DataSpec, tok) -> str | None:
    if spec.chat_template == "chatml":
        return CHATML
    return spec.chat_template or getattr(tok, "chat_template", None)


def chat_layout(spec: DataSpec, tok) -> bool:
    """Whether `instruction` and `prompt_completion` rows with text fields train as a two-turn chat
    (data.prompt_template; `auto`: whenever there is a chat template to render them with)."""
    if spec.prompt_template == "auto":
        return chat_template(spec, tok) is not None
    return spec.prompt_template == "chat"


def instruction_prompt(row: dict) -> str:
    """Alpaca-style fields as one prompt (the same layout `finetune eval` prompts with)."""
    return row["instruction"] + ("\n" + row["input"] if row.get("input") else "") + "\n"


def instruction_user(row: dict) -> str:
    """An instruction row's user turn in the chat layout (`chat_layout`): the instruction, then its input."""
    return row["instruction"] + ("\n\n" + row["input"] if row.get("input") else "")


def plain_chat(row: dict, fmt: str) -> list[dict]:
    """An instruction or prompt/completion row as the two-turn chat the chat layout trains."""
    if fmt == "instruction":
        prompt, answer = instruction_user(row), _str(row, "output")
    else:
        prompt, answer = _str(row, "prompt"), _str(row, "completion")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _ids(tok, text: str, special: bool, max_len: int | None = None) -> list[int]:
    """Token ids of `text`; with `max_len`, of a prefix long enough for max_len tokens (see CHARS_PER_TOKEN_CAP)."""
    cut = cut_text(text, max_len)
    ids = tok(cut, add_special_tokens=special)["input_ids"]
    if cut is not text and len(ids) <= max_len:  # pathological: very long tokens; the whole text decides
        ids = tok(text, add_special_tokens=special)["input_ids"]
    return ids


def cut_text(text: str, max_len: int | None) -> str:
    """`text` itself, or its first max_len x CHARS_PER_TOKEN_CAP characters when it is longer."""
    if max_len is None or len(text) <= max_len * CHARS_PER_TOKEN_CAP:
        return text
    return text[: max_len * CHARS_PER_TOKEN_CAP]


def _eos(tok) -> list[int]:
    """The end-of-sequence token that closes a completion or a text, if the tokenizer has one."""
    return [tok.eos_token_id] if tok.eos_token_id is not None else []


def _prompt_completion(tok, prompt: str, completion: str, train_on_inputs: bool, max_len: int) -> dict:
    # Prompt and completion are tokenized apart, as at inference (the prompt alone, then generation),
    # so the boundary is exact and no completion token is lost to a merge with the prompt's last bytes.
    p = _ids(tok, prompt, special=True, max_len=max_len)
    c = _ids(tok, completion, special=False, max_len=max_len) + _eos(tok)
    labels = (p if train_on_inputs else [IGNORE] * len(p)) + c
    return {"input_ids": p + c, "labels": labels}


def encode_all(row: dict, fmt: str, tok, spec: DataSpec) -> list[dict]:
    """One row -> its training examples: one, except for a chat whose template rewrites history (one per
    trained turn that a later turn's rendering rewrites; see chat.py). Chat examples also carry "turns" and
    "check" (the inference-rendering check). Raises ValueError for a row that does not fit `fmt`."""
    fmt = (detect_format(row) or "unknown") if fmt == "auto" else fmt
    template, n = chat_template(spec, tok), spec.max_seq_len
    if fmt == "preference":
        return [encode_pair(row, tok, spec)]
    if fmt == "prompt_completion" and isinstance(row.get("prompt"), list):  # conversational: the completion trains
        return chat_examples(tok, _cut_turns(row["prompt"] + row["completion"], n), template, row.get("tools"),
                             spec.train_on_inputs, first_trained=len(row["prompt"]), key="prompt+completion")
    if fmt == "messages":
        return chat_examples(tok, _cut_turns(row["messages"], n), template, row.get("tools"), spec.train_on_inputs)
    if fmt == "sharegpt":
        msgs = [{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from")), "content": t.get("value")}
                for t in row["conversations"]]
        return chat_examples(tok, _cut_turns(msgs, n), template, row.get("tools"), spec.train_on_inputs,
                             key="conversations")
    return [encode(row, fmt, tok, spec)]


def pair_prompt(row: dict):
    """(prompt, chosen, rejected) of a preference row: strings, or message lists (the shared prompt given, or
    every message but the last of each chat)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str):
        return row.get("prompt") or "", chosen, rejected
    if row.get("prompt") is not None:
        return row["prompt"], chosen, rejected
    return chosen[:-1], chosen[-1:], rejected[-1:]


def encode_pair(row: dict, tok, spec: DataSpec) -> dict:
    """A preference row -> its chosen sequence (input_ids, labels) and its rejected one (rejected_ids,
    rejected_labels): the same prompt, rendered as SFT renders it, then each answer; only the answer tokens
    are scored (train_on_inputs does not apply: a prompt's log-prob is the same on both sides)."""
    prompt, chosen, rejected = pair_prompt(row)
    if isinstance(chosen, str) and chat_layout(spec, tok):  # text pairs in the layout text rows train in
        prompt = [{"role": "user", "content": prompt}]
        chosen, rejected = ([{"role": "assistant", "content": a}] for a in (chosen, rejected))
    n, sides = spec.max_seq_len, []
    for answer in (chosen, rejected):
        if isinstance(answer, str):
            sides.append(_prompt_completion(tok, prompt, answer, False, n))
            continue
        examples = chat_examples(tok, _cut_turns(prompt + answer, n), chat_template(spec, tok), row.get("tools"),
                                 False, first_trained=len(prompt), key="prompt+answer")
        if len(examples) != 1:
            raise ValueError(f"this answer trains as {len(examples)} examples (the template rewrites history); "
                             "a preference answer must be one")
        sides.append(examples[0])
    (c, r) = sides
    return {"input_ids": c["input_ids"], "labels": c["labels"], "rejected_ids": r["input_ids"],
            "rejected_labels": r["labels"], "turns": c.get("turns", 0) + r.get("turns", 0),
            "check": "; ".join(x for x in (c.get("check"), r.get("check")) if x)}


def render_chat(tok, messages: list[dict], template: str, gen: bool = False, tools: list | None = None) -> str:
    """The chat as training renders it (chat.normalize, the row's tools); with `gen`, followed by the
    template's start of an assistant turn. The template is code from the tokenizer or the run dir
    (data/template.py: bounded, its own faults TemplateRefused); one that refuses this conversation
    is a RecipeError naming where it came from (exit 2), not a Jinja traceback."""
    import jinja2

    from finetune.data import template as T
    from finetune.data.chat import normalize

    try:
        return T.apply(tok, template, conversation=normalize(messages), tools=tools, tokenize=False,
                       add_generation_prompt=gen)
    except jinja2.TemplateError as e:
        said = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise RecipeError([f"{T.origin(tok, template)}: the chat template refuses this conversation ({said!r}); "
                           "give the messages it expects, or set data.chat_template"]) from None


def prompt_ids(tok, prompt, template: str | None = None) -> list[int]:
    """The token ids training gives a prompt, for generation to continue from: a chat (a list of messages,
    or {"messages", "tools"} for a row with tools) rendered up to the start of the next assistant turn and
    tokenized without added special tokens, as training tokenizes a turn's prompt (chat.py); a text prompt
    with the tokenizer's special tokens, as `_prompt_completion` tokenizes it."""
    if isinstance(prompt, (list, dict)):
        if not template:
            raise ValueError("a chat prompt needs a chat template: the tokenizer has none; set data.chat_template")
        msgs, tools = (prompt["messages"], prompt.get("tools")) if isinstance(prompt, dict) else (prompt, None)
        return tok(render_chat(tok, msgs, template, gen=True, tools=tools), add_special_tokens=False)["input_ids"]
    return tok(prompt, add_special_tokens=True)["input_ids"]


def chat_messages(row: dict) -> list[dict] | None:
    """A chat row's messages in {"role", "content"} form (messages, sharegpt, conversational
    prompt/completion), None for other rows."""
    if isinstance(row.get("messages"), list):
        return row["messages"]
    if isinstance(row.get("conversations"), list):
        return [{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from")), "content": t.get("value")}
                for t in row["conversations"]]
    if isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
        return row["prompt"] + row["completion"]
    return None


def last_turn(row: dict) -> tuple[list[dict] | dict, str] | None:
    """(the messages before the last assistant turn, that turn's text) of a chat row, None when it has none;
    for a row with tools the messages come as {"messages", "tools"} (see prompt_ids)."""
    from finetune.data.formats import parse_json_field

    msgs = chat_messages(row)
    for i in range(len(msgs or []) - 1, 0, -1):
        if msgs[i].get("role") == "assistant" and isinstance(msgs[i].get("content"), str):
            tools = parse_json_field(row["tools"], list) if row.get("tools") else None
            return ({"messages": msgs[:i], "tools": tools} if tools else msgs[:i]), msgs[i]["content"]
    return None


def encode(row: dict, fmt: str, tok, spec: DataSpec) -> dict:
    """One row -> {"input_ids", "labels"}. Raises ValueError for a row that does not fit `fmt`, or a chat
    that trains as several examples (use encode_all)."""
    fmt = (detect_format(row) or "unknown") if fmt == "auto" else fmt
    n = spec.max_seq_len
    if fmt in ("messages", "sharegpt") or (fmt == "prompt_completion" and isinstance(row.get("prompt"), list)):
        examples = encode_all(row, fmt, tok, spec)
        if len(examples) > 1:
            raise ValueError(f"this chat trains as {len(examples)} examples (its template rewrites history)")
        return examples[0]
    if fmt in ("prompt_completion", "instruction") and chat_layout(spec, tok):
        _str(row, "instruction" if fmt == "instruction" else "prompt")
        return chat_examples(tok, _cut_turns(plain_chat(row, fmt), n), chat_template(spec, tok), None,
                             spec.train_on_inputs)[0]  # two turns: one example
    if fmt == "prompt_completion":
        return _prompt_completion(tok, _str(row, "prompt"), _str(row, "completion"), spec.train_on_inputs, n)
    if fmt == "instruction":
        _str(row, "instruction")
        return _prompt_completion(tok, instruction_prompt(row), _str(row, "output"), spec.train_on_inputs, n)
    if fmt == "tokens":  # pre-tokenized: used as they are (no special tokens added); labels default to all
        ids = list(row["input_ids"])
        return {"input_ids": ids, "labels": list(row["labels"]) if row.get("labels") is not None else list(ids)}
    if fmt == "text":  # continued pretraining: every token trains
        ids = _ids(tok, _str(row, "text"), special=True, max_len=n) + _eos(tok)
        return {"input_ids": ids, "labels": list(ids)}
    raise ValueError(f"unknown format {fmt}")


def _cut_turns(messages: list, max_len: int) -> list:
    """Each turn's text and reasoning cut like any text (a turn cut there already reaches past max_seq_len on
    its own)."""
    return [{**m, **{k: cut_text(m[k], max_len) for k in ("content",) + REASONING_KEYS if isinstance(m.get(k), str)}}
            if isinstance(m, dict) else m for m in messages]


def _str(row: dict, key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise ValueError(f"field '{key}' is missing or not a string")
    if not v.strip() and key in ("completion", "output", "text", "instruction"):
        raise ValueError(f"field '{key}' is empty")
    return v
