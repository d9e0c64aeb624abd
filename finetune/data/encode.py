"""Encoding one row: {"input_ids": [...], "labels": [...]} where labels are -100 (IGNORE) on tokens that do
not train (prompts, user turns, templates' headers) so the loss covers exactly the completion / assistant
spans. Prompt/completion and instruction rows are tokenized in two parts; chats are rendered with the
recipe's or the tokenizer's chat template; text rows train on every token.
"""
from __future__ import annotations

import re

from finetune.data.formats import SHAREGPT_ROLES, detect_format
from finetune.recipe import DataSpec

IGNORE = -100
ENCODER_VERSION = 3  # part of the cache key: bump when encode() changes what it produces
# Text is cut to max_seq_len x this many characters before it is tokenized (bounded time and memory per row,
# whatever the row's size). Tokens average about 4 characters; a piece cut here still makes far more tokens
# than max_seq_len, so the first max_seq_len tokens, and whether the row is too long, stay exactly the same.
# Should a cut piece make fewer (runs of 32+ characters per token), it is tokenized whole instead.
CHARS_PER_TOKEN_CAP = 32

# ChatML, for tokenizers without a template of their own (`data.chat_template: chatml`).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def chat_template(spec: DataSpec, tok) -> str | None:
    if spec.chat_template == "chatml":
        return CHATML
    return spec.chat_template or getattr(tok, "chat_template", None)


def instruction_prompt(row: dict) -> str:
    """Alpaca-style fields as one prompt (the same layout `finetune eval` prompts with)."""
    return row["instruction"] + ("\n" + row["input"] if row.get("input") else "") + "\n"


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


def _chat(tok, messages: list[dict], template: str | None, train_on_inputs: bool, first_trained=None) -> dict:
    """Render a chat and train on its assistant turns (or, for conversational prompt/completion, on the
    messages from `first_trained` on). A template with {% generation %} marks the trained tokens itself;
    otherwise each trained turn's characters are found by rendering the chat up to before and after it,
    and the tokens of the full rendering whose first character falls there are trained."""
    if not template:
        raise ValueError("chat data needs a chat template: the tokenizer has none; set data.chat_template "
                         "(a Jinja template, or `chatml`)")
    render = lambda msgs, gen=False: render_chat(tok, msgs, template, gen)  # noqa: E731
    if first_trained is None and _GENERATION_TAG.search(template):
        enc = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), enc["assistant_masks"]
        return {"input_ids": ids, "labels": [t if (m or train_on_inputs) else IGNORE for t, m in zip(ids, mask)]}
    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if (m["role"] == "assistant") if first_trained is None else (i >= first_trained):
            upto = render(messages[: i + 1])
            # transformers cannot render an empty chat: for a first message, its header ends where its content starts
            head = render(messages[:i], gen=m["role"] == "assistant") if i else upto[: max(upto.find(m["content"]), 0)]
            if not (full.startswith(upto) and upto.startswith(head)):
                raise ValueError("the chat template does not render the start of a chat as a prefix of the "
                                 "whole (it rewrites earlier turns); give it {% generation %} markers")
            spans.append((len(head), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if train_on_inputs or any(a <= s < b for a, b in spans) else IGNORE
              for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
    return {"input_ids": list(enc["input_ids"]), "labels": labels}


def render_chat(tok, messages: list[dict], template: str, gen: bool = False) -> str:
    """The chat as text; with `gen`, followed by the template's start of an assistant turn."""
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen)


def prompt_ids(tok, prompt, template: str | None = None) -> list[int]:
    """The token ids training gives a prompt, for generation to continue from: a chat (a list of messages)
    rendered up to the start of the next assistant turn and tokenized without added special tokens, as
    `_chat` tokenizes the whole rendering; a text prompt with the tokenizer's special tokens, as
    `_prompt_completion` tokenizes it."""
    if isinstance(prompt, list):
        if not template:
            raise ValueError("a chat prompt needs a chat template: the tokenizer has none; set data.chat_template")
        return tok(render_chat(tok, prompt, template, gen=True), add_special_tokens=False)["input_ids"]
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


def last_turn(row: dict) -> tuple[list[dict], str] | None:
    """(the messages before the last assistant turn, that turn's text) of a chat row, None when it has none."""
    msgs = chat_messages(row)
    for i in range(len(msgs or []) - 1, 0, -1):
        if msgs[i].get("role") == "assistant" and isinstance(msgs[i].get("content"), str):
            return msgs[:i], msgs[i]["content"]
    return None


def encode(row: dict, fmt: str, tok, spec: DataSpec) -> dict:
    """One row -> {"input_ids", "labels"}. Raises ValueError for a row that does not fit `fmt`."""
    fmt = (detect_format(row) or "unknown") if fmt == "auto" else fmt
    template, n = chat_template(spec, tok), spec.max_seq_len
    if fmt == "prompt_completion":
        if isinstance(row.get("prompt"), list):  # conversational: train on the completion messages
            return _chat(tok, _cut_turns(row["prompt"] + row["completion"], n), template, spec.train_on_inputs,
                         first_trained=len(row["prompt"]))
        return _prompt_completion(tok, _str(row, "prompt"), _str(row, "completion"), spec.train_on_inputs, n)
    if fmt == "instruction":
        _str(row, "instruction")
        return _prompt_completion(tok, instruction_prompt(row), _str(row, "output"), spec.train_on_inputs, n)
    if fmt == "messages":
        return _chat(tok, _cut_turns(row["messages"], n), template, spec.train_on_inputs)
    if fmt == "sharegpt":
        return _chat(tok, _cut_turns(chat_messages(row), n), template, spec.train_on_inputs)
    if fmt == "text":  # continued pretraining: every token trains
        ids = _ids(tok, _str(row, "text"), special=True, max_len=n) + _eos(tok)
        return {"input_ids": ids, "labels": list(ids)}
    raise ValueError(f"unknown format {fmt}")


def _cut_turns(messages: list, max_len: int) -> list:
    """Each turn's text cut like any text (a turn cut there already reaches past max_seq_len on its own)."""
    return [{**m, "content": cut_text(m["content"], max_len)} if isinstance(m, dict) and isinstance(m.get("content"), str)
            else m for m in messages]


def _str(row: dict, key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise ValueError(f"field '{key}' is missing or not a string")
    if not v.strip() and key in ("completion", "output", "text", "instruction"):
        raise ValueError(f"field '{key}' is empty")
    return v
