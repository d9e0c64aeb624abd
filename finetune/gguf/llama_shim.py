"""Run one of llama.cpp's converter scripts unchanged, after registering pre-tokenizers it does not know.

    python -m finetune.gguf.llama_shim SCRIPT PRE_TOKENIZERS_JSON [script args...]

Why: the converter names a BPE tokenizer's pre-tokenizer by hashing the token ids of a fixed probe text
(`chktxt` in `get_vocab_base_pre`) and refuses a hash it has not seen. A tokenizer trained here (the builtin
tiny Llama's) has its own vocabulary, hence its own hash, though it pre-tokenizes exactly like a known one. We
wrap `get_vocab_base_pre`: a hash in PRE_TOKENIZERS_JSON returns its registered name; every other hash goes to
the converter's own table. The probe text is read from the converter's source, so the hash is the one the
pinned converter computes. Imports only the standard library and the converter's packages (it runs in a
child process whose sys.path starts with the converter dir).
"""
from __future__ import annotations

import ast
import inspect
import json
import logging
import runpy
import sys
import textwrap
from hashlib import sha256
from pathlib import Path


def probe_text(fn) -> str:
    """The `chktxt = '...'` literal inside the converter's get_vocab_base_pre."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "chktxt" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("the converter's get_vocab_base_pre has no chktxt literal: unsupported converter version")


def chkhsh(tokenizer, text: str) -> str:
    """The converter's identifier of a BPE pre-tokenizer: sha256 of str(token ids of the probe text)."""
    return sha256(str(tokenizer.encode(text)).encode()).hexdigest()


def register(known: dict[str, str]) -> None:
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre
    text = probe_text(original)

    def get_vocab_base_pre(self, tokenizer) -> str:
        h = chkhsh(tokenizer, text)
        if h in known:
            logging.getLogger("finetune").info(f"pre-tokenizer {h[:12]}... registered by finetune: {known[h]}")
            return known[h]
        return original(self, tokenizer)

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str]) -> None:
    script, known = Path(argv[0]), json.loads(argv[1])
    sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]  # what the script itself would add
    if known:
        register(known)
    sys.argv = [str(script), *argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
