"""Chat rows to training examples: OpenAI-format messages (tool calls, tool results, reasoning) and a `tools`
list rendered with the chat template, with the loss on the assistant turns only.

Every trained turn trains as inference renders it. Its prompt P is the template's rendering of the messages
before it with the generation prompt (`add_generation_prompt=True`, what a server sends the model); its
target is what the template adds for the turn when the turn is the latest message (U, the rendering of the
messages through it, minus P). Templates that rewrite history (Qwen3 drops the reasoning of the assistant
turns before the last user message) render an earlier turn differently once later turns exist, so training on
one rendering of the whole chat would teach the model to answer without the reasoning it produces at
inference. Hence: a turn whose U is a prefix of a later turn's U trains inside that turn's example (a template
that never rewrites gives one example per row); the turns the later rendering rewrites get examples of their own.

Each example also records, per trained turn, whether its tokens before the turn are exactly the tokenized
inference prompt and its tokens through the turn the tokenized U: `finetune data` reports it.
"""
from __future__ import annotations

import re

from finetune.data.formats import REASONING_KEYS, content_text, parse_json_field
from finetune.data.template import apply

IGNORE = -100
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# Stands in for an opening assistant turn's text to find where the template starts it (there is no
# conversation before it to render with a generation prompt).
_SENTINEL = "\u2063finetune-opening-turn\u2063"


def normalize(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: null fields dropped, text parts joined into one string, and
    tool-call arguments given as JSON text parsed into objects (templates `tojson` them; vLLM parses them the
    same way before it renders a conversation)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(m.get("content"), list):
            m["content"] = content_text(m["content"])
        if m.get("tool_calls"):
            m["tool_calls"] = [_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _call(call: dict) -> dict:
    fn = dict(call.get("function", call))
    if fn.get("arguments") is not None:
        fn["arguments"] = parse_json_field(fn["arguments"], dict)
    return {**call, "function": fn} if "function" in call else fn


class Chat:
    """One conversation, its tools and the template that renders them."""

    def __init__(self, tok, messages: list[dict], template: str, tools: list | None, key: str):
        self.tok, self.msgs, self.template, self.tools, self.key = tok, messages, template, tools, key

    def text(self, n: int, gen: bool = False) -> str:
        """The rendering of the first n messages (with the generation prompt: what inference sends)."""
        return apply(self.tok, self.template, conversation=self.msgs[:n], tools=self.tools, tokenize=False,
                     add_generation_prompt=gen)

    def ids(self, text: str) -> list[int]:
        """Token ids as apply_chat_template(tokenize=True) makes them: the rendered text, no added specials."""
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, i: int) -> str:
        if i:
            return self.text(i, gen=True)
        # transformers renders no empty chat: an opening assistant turn's prompt is what the template writes
        # before a message's text
        opening = apply(self.tok, self.template, conversation=[{"role": "assistant", "content": _SENTINEL}],
                        tools=self.tools, tokenize=False)
        return opening[: max(opening.find(_SENTINEL), 0)]

    def generation_mask(self, n: int, ids: list[int]) -> list[int]:
        """The template's own {% generation %} marks over the rendering of the first n messages."""
        enc = apply(self.tok, self.template, conversation=self.msgs[:n], tools=self.tools, tokenize=True,
                    return_dict=True, return_assistant_tokens_mask=True)
        if list(enc["input_ids"]) != ids:
            raise ValueError("the chat template's generation marks do not line up with its rendering")
        return list(enc["assistant_masks"])


def _unrendered(m: dict, completion: str) -> str | None:
    """What of an assistant turn the template left out of the turn's rendering (a template that reads other
    field names would otherwise train the model to answer without it, silently)."""
    reasoning = next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str)), "").strip()
    if reasoning and reasoning not in completion:
        return "its reasoning is not in the rendered turn: the chat template does not render reasoning_content"
    for j, call in enumerate(m.get("tool_calls") or []):
        if call.get("function", call)["name"] not in completion:
            return f"tool_calls[{j}] is not in the rendered turn: the chat template does not render tool calls"
    return None


def _turns(chat: Chat, trained: list[int]) -> dict[int, tuple[str, str]]:
    """Turn index -> (its inference prompt P, the rendering U of the chat through it)."""
    out = {}
    for i in trained:
        prompt, through = chat.prompt(i), chat.text(i + 1)
        if not through.startswith(prompt):
            raise ValueError(f"{chat.key}[{i}]: the chat template does not render this turn after its own "
                             "generation prompt (the rendering before the turn is not a prefix of the rendering "
                             "through it)")
        why = _unrendered(chat.msgs[i], through[len(prompt):])
        if why:
            raise ValueError(f"{chat.key}[{i}]: {why}")
        out[i] = (prompt, through)
    return out


def _groups(turns: dict[int, tuple[str, str]]) -> list[tuple[int, list[int]]]:
    """(last turn, the turns that train in its example), in chat order: a turn trains in a later turn's
    example when the later rendering starts with the turn's own rendering (nothing before it rewritten)."""
    left, out = sorted(turns), []
    while left:
        last = left[-1]
        members = [i for i in left if turns[last][1].startswith(turns[i][1])]
        out.append((last, members))
        left = [i for i in left if i not in members]
    return out[::-1]


def _check(chat: Chat, ids: list[int], starts: list[int], turns: dict, members: list[int]) -> dict:
    """Per trained turn: the example's tokens before it equal the tokenized inference prompt, and its tokens
    through it the tokenized rendering of the chat ending with it. An opening assistant turn has no prompt
    to compare with and is not counted."""
    checked, bad = 0, []
    for i in members:
        if i == 0:
            continue
        prompt, through = turns[i]
        checked += 1
        before, upto = sum(s < len(prompt) for s in starts), sum(s < len(through) for s in starts)
        if ids[:before] != chat.ids(prompt):
            bad.append(f"{chat.key}[{i}]: the tokens before the turn are not the tokenized inference prompt")
        elif ids[:upto] != chat.ids(through):
            bad.append(f"{chat.key}[{i}]: the tokens through the turn are not the tokenized chat ending with it")
    return {"turns": checked, "check": "; ".join(bad)}


def _example(chat: Chat, turns: dict, last: int, members: list[int], marked: bool) -> dict:
    enc = chat.tok(turns[last][1], add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = list(enc["input_ids"]), [s for s, _ in enc["offset_mapping"]]
    # A token trains when its first character lies in a member turn's target (and, for a template with
    # {% generation %} marks, the template marks it).
    spans = [(len(turns[i][0]), len(turns[i][1])) for i in members]
    mask = chat.generation_mask(last + 1, ids) if marked else [1] * len(ids)
    labels = [t if m and any(a <= s < b for a, b in spans) else IGNORE for t, s, m in zip(ids, starts, mask)]
    return {"input_ids": ids, "labels": labels, **_check(chat, ids, starts, turns, members)}


def chat_examples(tok, messages: list[dict], template: str | None, tools, train_on_inputs: bool,
                  first_trained: int = 0, key: str = "messages") -> list[dict]:
    """The training examples of one chat: {"input_ids", "labels", "turns", "check"} each (see the module
    docstring). Assistant turns from `first_trained` on train; tool results, user and system turns never do.
    With train_on_inputs, one example of the whole rendering trains every token."""
    if not template:
        raise ValueError("chat data needs a chat template: the tokenizer has none; set data.chat_template "
                         "(a Jinja template, or `chatml`)")
    import jinja2

    tools = parse_json_field(tools, list) if tools is not None else None
    chat = Chat(tok, normalize(messages), template, tools, key)
    try:
        return _examples(chat, train_on_inputs, first_trained)
    except jinja2.TemplateError as e:  # a raw Jinja message names no row, turn or field
        raise ValueError(template_error(chat, e)) from None


def _examples(chat: Chat, train_on_inputs: bool, first_trained: int) -> list[dict]:
    template, tools = chat.template, chat.tools
    if train_on_inputs:
        ids = chat.ids(chat.text(len(chat.msgs)))
        return [{"input_ids": ids, "labels": list(ids), "turns": 0, "check": ""}]
    trained = [i for i, m in enumerate(chat.msgs) if i >= first_trained and m["role"] == "assistant"]
    if not trained:  # nothing trains: dropped and counted later, like any example without trained tokens
        ids = chat.ids(chat.text(len(chat.msgs)))
        return [{"input_ids": ids, "labels": [IGNORE] * len(ids), "turns": 0, "check": ""}]
    turns = _turns(chat, trained)
    for tool in tools or []:
        name = tool.get("function", tool)["name"]
        if name not in turns[trained[0]][1]:
            raise ValueError(f"field 'tools': the chat template does not render tools ({name!r} is not in the "
                             "rendered chat)")
    marked = bool(GENERATION_TAG.search(template))
    return [_example(chat, turns, last, members, marked) for last, members in _groups(turns)]


_FIELD = re.compile(r"has no attribute '([^']+)'|'([^']+)' is undefined|object has no element '?([^' ]+)")


def template_error(chat: Chat, e: Exception) -> str:
    """A chat template's exception as the turn it fails on (the first prefix of the chat that does not render),
    the field it reads there, and the fix."""
    import jinja2

    def fails(n: int) -> bool:
        try:
            chat.text(n)
        except jinja2.TemplateError:
            return True
        return False

    raw = str(e).splitlines()[0] if str(e) else type(e).__name__
    n = next((n for n in range(1, len(chat.msgs) + 1) if fails(n)), None)
    if n is None:
        return f"the chat template fails on this row: {raw}"
    m = chat.msgs[n - 1]
    turn = f"{chat.key}[{n - 1}] ({m.get('role', '?')}{', with tool_calls' if m.get('tool_calls') else ''})"
    found = _FIELD.search(raw)
    field = next((g for g in found.groups() if g), None) if found else None
    why = (f"the chat template reads '{field}', which this turn does not have (null or absent)"
           if field and field not in m else f"the chat template fails on this turn: {raw}")
    if m.get("tool_calls") and "tool_calls" not in chat.template:
        fix = ("this template never reads tool_calls, so it cannot train tool calls: use a model whose chat "
               "template renders them, or set data.chat_template to one that does")
    elif m.get("role") == "tool" and "tool" not in chat.template.replace("tool_calls", ""):
        fix = "this template has no tool role: use a template that renders tool results, or drop the tool turns"
    else:
        fix = f"give every {m.get('role', '?')} turn the fields the template reads, or set data.chat_template"
    return f"{turn}: {why}. Fix: {fix}"
