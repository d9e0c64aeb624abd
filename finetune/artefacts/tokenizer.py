"""Tokenizer files in the form the clients people deploy with read, not only the transformers
that wrote them.

What transformers 5 writes and older readers trip on (llama.cpp's converter pins transformers 4.57, TGI 4.51):
- `tokenizer_class: TokenizersBackend` is a 5.x name; 4.x has no such class. `PreTrainedTokenizerFast` names
  the same thing (a tokenizer.json-backed tokenizer) in both: 5.x maps it to TokenizersBackend.
- `extra_special_tokens` as a list: 4.57 reads that key only as a dict of named tokens and fails on a list.
  `additional_special_tokens` (the 4.x key) is read by 5.x too (it renames it on load).
- No `add_bos_token`: a reader that cannot see the post-processor (llama.cpp) guesses, and prepends BOS to a
  model that never saw one in training. We write what the tokenizer actually does.
- The chat template only in chat_template.jinja: TGI and 4.x before 4.43 read it only from
  tokenizer_config.json. We keep the .jinja file and put the same text inline.
"""
from __future__ import annotations

import json
from pathlib import Path

from finetune.util import atomic

PORTABLE_CLASS = "PreTrainedTokenizerFast"
_CONFIG = "tokenizer_config.json"
# Names that exist only in transformers 5 (its generic tokenizer.json backend).
_V5_ONLY_CLASSES = {"TokenizersBackend", "TokenizersBackendFast"}
# How the tokenizer was loaded, which transformers 5 also saves; meaningless to the next reader.
_LOAD_ARGUMENTS = {"is_local", "local_files_only"}


def adds_bos_eos(tok) -> tuple[bool, bool]:
    """Whether encoding with special tokens (what training and eval do) puts BOS first / EOS last."""
    probe = "a b"
    with_special = tok(probe, add_special_tokens=True)["input_ids"]
    plain = tok(probe, add_special_tokens=False)["input_ids"]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    adds_bos = bos is not None and with_special[:1] == [bos] and plain[:1] != [bos]
    adds_eos = eos is not None and with_special[-1:] == [eos] and plain[-1:] != [eos]
    return adds_bos, adds_eos


def portable_config(cfg: dict, tok, template: str | None) -> dict:
    """tokenizer_config.json as transformers 5 wrote it -> a form 4.x and 5.x both read (see module doc)."""
    cfg = {k: v for k, v in cfg.items() if k not in _LOAD_ARGUMENTS}
    if cfg.get("tokenizer_class") in _V5_ONLY_CLASSES or cfg.get("tokenizer_class") is None:
        cfg["tokenizer_class"] = PORTABLE_CLASS
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, dict):
        cfg["extra_special_tokens"] = extra  # the named-token form, which 4.57 reads
    elif extra:
        listed = [t if isinstance(t, str) else t.get("content", str(t)) for t in extra]
        cfg["additional_special_tokens"] = listed
    cfg["add_bos_token"], cfg["add_eos_token"] = adds_bos_eos(tok)
    if template:
        cfg["chat_template"] = template
    return cfg


def chat_template_text(tok) -> str | None:
    """The default chat template as text (a tokenizer may hold several by name; 'default' is the one used)."""
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default")
    return t if isinstance(t, str) and t else None


def save_tokenizer(tok, out: Path) -> None:
    """tok.save_pretrained(out), then tokenizer_config.json rewritten in the portable form."""
    out = Path(out)
    tok.save_pretrained(str(out))
    make_portable(out, tok)


def make_portable(out: Path, tok) -> None:
    path = Path(out) / _CONFIG
    if not path.is_file():
        return
    template = chat_template_text(tok)
    jinja = Path(out) / "chat_template.jinja"
    if template and not jinja.is_file():
        atomic.write_text(jinja, template)  # both places, whichever a client reads
    cfg = portable_config(json.loads(path.read_text()), tok, template)
    atomic.write_text(path, json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
