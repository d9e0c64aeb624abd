"""Every render of a chat template goes through `apply`. A chat template is a Jinja program from a tokenizer
or a run dir (`adapter/chat_template.jinja`, `tokenizer_config.json`, `data.chat_template`): transformers runs
it in Jinja's immutable sandbox, which holds, but reports what it refused as an exception from deep inside
Jinja (`SecurityError`, `TypeError: no loader for this environment specified`, a range too big), and a
template that loops never returns. Those are faults of the template, not of a row or a prompt: each becomes
one `TemplateRefused` (exit 2) naming the file the template came from and what it tried. A plain
`TemplateError` (the template's own `raise_exception`, a field a row lacks) passes through: data preparation
reports it as a bad row (chat.py), inference as a refused conversation (encode.render_chat).
"""
from __future__ import annotations

from pathlib import Path

from finetune.util.errors import RecipeError

FIX = "replace the template (data.chat_template, or chat_template.jinja beside the tokenizer) with one that only " \
      "formats messages"


class TemplateRefused(RecipeError):
    """The chat template itself cannot be used (the sandbox refused it, it loads other templates, it loops)."""


def origin(tok, template) -> str:
    """The file (or recipe field) `template` came from: the tokenizer's chat_template.jinja or
    tokenizer_config.json when it is the tokenizer's own, else data.chat_template."""
    if template is not None and template == getattr(tok, "chat_template", None):
        where = Path(getattr(tok, "name_or_path", "") or ".")
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            if (where / name).is_file():
                return str(where / name)
        return f"the chat template of the tokenizer {where}"
    return "data.chat_template"


def _tried(e: Exception) -> str | None:
    """What a template that failed with `e` tried, when it is the template's fault whatever it renders."""
    import jinja2

    msg = (str(e).splitlines() or [type(e).__name__])[0][:200]
    if isinstance(e, jinja2.exceptions.SecurityError):
        return f"it tried to reach Python internals, which the sandbox refused ({msg})"
    if isinstance(e, jinja2.exceptions.TemplateNotFound) or (isinstance(e, TypeError) and "no loader" in msg):
        return "it tried to load another template ({% include %}, {% import %} or {% extends %}), which is not allowed"
    if isinstance(e, OverflowError) and "sandbox" in msg.lower():
        return f"it asked for more than the sandbox allows ({msg})"
    return None


def apply(tok, template: str, **kwargs):
    """`tok.apply_chat_template(chat_template=template, **kwargs)` within the time budget (util/budget);
    TemplateRefused (exit 2) for the faults that are the template's; other TemplateErrors pass through."""
    from finetune.util.budget import limited

    try:
        with limited("the chat template", f"{FIX}, or raise FINETUNE_TEMPLATE_SECONDS", error=TemplateRefused):
            return tok.apply_chat_template(chat_template=template, **kwargs)
    except TemplateRefused as e:  # named where it came from only now: a render that works never looks at files
        raise TemplateRefused([f"{origin(tok, template)}: {p}" for p in e.problems]) from None
    except Exception as e:  # noqa: BLE001 - re-raised unless it is one of the template's own faults (_tried)
        tried = _tried(e)
        if tried is None:
            raise
        raise TemplateRefused([f"{origin(tok, template)}: the chat template cannot be used: {tried}; {FIX}"]) from None


def check(tok, template: str | None) -> None:
    """Render one user turn before anything heavy loads or any output is written: a template the sandbox
    refuses, one that loads other templates or one that loops is TemplateRefused now. A template that merely
    rejects this conversation (it wants a system turn first, ...) is left to the render that needs it."""
    import jinja2

    if not template:
        return
    try:
        apply(tok, template, conversation=[{"role": "user", "content": "hi"}], tokenize=False,
              add_generation_prompt=True)
    except jinja2.TemplateError:
        pass


def check_system(tok, template: str, argument: str = "--system") -> None:
    """A system message with a template that has no system turn (Gemma's and Mistral's raise on one): one
    RecipeError naming `argument`, not the TemplateError of every render."""
    import jinja2

    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        apply(tok, template, conversation=chat, tokenize=False, add_generation_prompt=True)
        return
    except jinja2.TemplateError as e:
        said = (str(e).splitlines() or [type(e).__name__])[0][:200]
    try:
        apply(tok, template, conversation=chat[1:], tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError:
        return  # it refuses the user turn too: the render that needs it says so
    raise RecipeError([f"{argument}: the model's template has no system turn ({origin(tok, template)} refuses one: "
                       f"{said!r}); leave out {argument}, or put the instructions in the first user message"])
