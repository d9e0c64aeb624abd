"""The Ollama Modelfile `finetune export` writes beside a GGUF of the merged model: FROM the file, a TEMPLATE in
Ollama's Go template syntax rendering chats as the run's Jinja chat template does, a `PARAMETER stop` for each
token that ends an answer (train/inference.stop_ids, what `generate` stops at), and the `ollama create` command.

Ollama never runs the Jinja template in the GGUF: without a TEMPLATE it falls back to a guess, and a fine-tuned
format it does not know is rendered wrongly. The translation is measured, not parsed: the Jinja template renders
a probe conversation whose contents are markers, which splits each message into a per-role prefix and suffix
around its content, plus a header before the messages and the generation prompt after them. The Go template
built from those pieces must then render two other conversations exactly as Jinja does; a template that does
not decompose this way (one that folds the system prompt into the first user turn, injects a default system
prompt or a date, numbers its turns) gets no TEMPLATE, and a comment saying why.
"""
from __future__ import annotations

import re
from pathlib import Path

from finetune.data.encode import render_chat
from finetune.data.template import TemplateRefused
from finetune.util.errors import RecipeError

HEADER = "# Ollama Modelfile for "  # what export's Modelfiles start with: the only files it replaces
PROBE = ("system", "user", "assistant", "user", "assistant", "user")
# Conversations the translation must reproduce: with and without a system turn, multi-line contents.
CHECKS = ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
           {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?\nSay it in words."}],
          [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi\nthere"},
           {"role": "user", "content": "bye"}])


class Untranslatable(ValueError):
    pass


def _pieces(tok, template: str) -> tuple[str, dict, str]:
    """(header, {role: (prefix, suffix)}, generation prompt) of `template`, or Untranslatable."""
    msgs = [{"role": r, "content": f"\x00{i}\x00"} for i, r in enumerate(PROBE)]
    try:
        rendered = [render_chat(tok, msgs[:k], template) for k in range(1, len(msgs) + 1)]
        full = render_chat(tok, msgs, template, gen=True)
        # what comes before the first message (a BOS, say): a chat of one user turn, less the user prefix
        first = render_chat(tok, [{"role": "user", "content": "\x000\x00"}], template).partition("\x000\x00")[0]
    except TemplateRefused:  # the sandbox refused it or it loops: an error, not a shape (export checks it first)
        raise
    except Exception as e:  # noqa: BLE001 - any template error means "not this shape"
        raise Untranslatable(f"it does not render a system, user, assistant conversation ({type(e).__name__}: "
                             f"{str(e)[:80]})") from None
    roles: dict[str, tuple[str, str]] = {}
    before = ""
    for i, (role, text) in enumerate(zip(PROBE, rendered)):
        if not text.startswith(before):
            raise Untranslatable("adding a message changes how the earlier ones render")
        prefix, found, suffix = text[len(before):].partition(f"\x00{i}\x00")
        if not found or "\x00" in prefix + suffix:
            raise Untranslatable(f"a {role} message's content is not rendered as given")
        if i and roles.setdefault(role, (prefix, suffix)) != (prefix, suffix):
            raise Untranslatable(f"{role} messages render differently by position")
        before = text
    if not first.endswith(roles["user"][0]):
        raise Untranslatable("the first user turn renders differently from the others")
    header = first[: len(first) - len(roles["user"][0])]
    system = rendered[0].partition("\x000\x00")
    if not system[0].startswith(header):
        raise Untranslatable("a system turn changes what comes before the first message")
    roles["system"] = (system[0][len(header):], system[2])
    if not full.startswith(before):
        raise Untranslatable("the generation prompt changes the messages before it")
    return header, roles, full[len(before):]


def _go(text: str) -> str:
    if "{{" in text or "}}" in text or '"""' in text:
        raise Untranslatable("its text contains {{, }} or \"\"\", which a Modelfile TEMPLATE cannot hold")
    return text


def translate(tok, template: str) -> str:
    """The Go template (Ollama's `.Messages` form) that renders chats as `template` does; Untranslatable."""
    header, roles, gen = _pieces(tok, template)
    for chat in CHECKS:  # the pieces must compose: render as Jinja does, start to end
        mine = header + "".join(roles[m["role"]][0] + m["content"] + roles[m["role"]][1] for m in chat) + gen
        if mine != render_chat(tok, chat, template, gen=True):
            raise Untranslatable("its pieces do not compose (a default system prompt, a date or a turn "
                                 "count in the template?)")
    bos = tok.bos_token
    if bos and header.startswith(bos) and tok("a")["input_ids"][:1] == [tok.bos_token_id]:
        header = header[len(bos):]  # llama.cpp adds the BOS itself (add_bos_token in the GGUF): not twice
    branches = "{{ else if ".join(f'eq .Role "{r}" }}}}{_go(p)}{{{{ .Content }}}}{_go(s)}'
                                  for r, (p, s) in roles.items())
    go = f"{_go(header)}{{{{ range .Messages }}}}{{{{ if {branches}{{{{ end }}}}{{{{ end }}}}{_go(gen)}"
    return go


def modelfile_text(gguf: Path, tok, template: str | None, stops: list[str]) -> str:
    # The file's path lands in the header comment, the `ollama create` line and FROM: a line break there would
    # start a directive of its own (export refuses such names up front; this keeps any other caller honest).
    if re.search(r"[\x00-\x1f\x7f]", str(gguf.with_suffix(".Modelfile"))):
        raise RecipeError([f"{str(gguf)!r}: a control character in the name would inject lines into the "
                           "Modelfile; choose a name without one"], "export")
    lines = [f"{HEADER}{gguf.name}, written by `finetune export`. To serve it:",
             f"#   ollama create NAME -f {gguf.with_suffix('.Modelfile')}",
             "#   ollama run NAME", f"FROM ./{gguf.name}"]
    why = "the run has no chat template" if not template else ""
    if template:
        try:
            lines.append(f'TEMPLATE """{translate(tok, template)}"""')
        except Untranslatable as e:
            why = f"the run's chat template cannot be translated to Ollama's Go template: {e}"
    if why:
        lines.insert(3, f"# No TEMPLATE: {why}; write one by hand that renders what training rendered.")
    # a Modelfile value cannot hold a quote or a line break; no special token of a real tokenizer has one
    lines += [f'PARAMETER stop "{s}"' for s in stops if re.fullmatch(r'[^"\n]+', s)]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf: Path, run_dir: Path, model_dir: Path) -> Path:
    """GGUF.with_suffix('.Modelfile') for the GGUF of the model in `model_dir`, exported from `run_dir`."""
    from transformers import AutoTokenizer

    from finetune.data.encode import chat_template
    from finetune.recipe.rundir import read_recipe
    from finetune.train.inference import stop_ids
    from finetune.util.atomic import write_text

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    template = chat_template(read_recipe(run_dir).data, tok) if (run_dir / "recipe.yaml").is_file() \
        else tok.chat_template
    stops = tok.convert_ids_to_tokens(stop_ids(tok, template))
    path = gguf.with_suffix(".Modelfile")
    if path.is_symlink() or (path.exists() and not path.read_text(errors="replace").startswith(HEADER)):
        raise RecipeError([f"{path}: exists and is not a Modelfile export wrote; the GGUF is written, the Modelfile "
                           "is not (move that file, or choose another --output)"], "export")
    write_text(path, modelfile_text(gguf, tok, template, stops))
    return path


def check_template(run_dir: Path, model_dir: Path | None) -> None:
    """Before export writes anything (a merge, the GGUF): the chat template the Modelfile will be made from
    (`model_dir`'s tokenizer for --merged, else the run's adapter's, which merge copies) must be one the
    sandbox runs and that ends (data/template.check: exit 2 naming its file)."""
    from transformers import AutoTokenizer

    from finetune.data.encode import chat_template
    from finetune.data.template import check
    from finetune.recipe.rundir import read_recipe

    src = model_dir or run_dir / "adapter"
    if not any((src / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        return  # the merge's tokenizer check reports a missing one
    tok = AutoTokenizer.from_pretrained(str(src))
    check(tok, chat_template(read_recipe(run_dir).data, tok) if (run_dir / "recipe.yaml").is_file()
          else tok.chat_template)
