"""Token ids of a tokenizer directory on a fixed set of strings, as JSON; or, with --compare PYTHON, the same
under this interpreter and under PYTHON (another transformers, e.g. 4.57 in scripts/check_tf4_tokenizer.sh),
printing one line per directory and exiting 1 on any difference.

Standalone on purpose (standard library + transformers only): it runs inside a venv that has no finetune.
"""
from __future__ import annotations

import json
import subprocess
import sys

SPECIALS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "reverse the words: red fox jumps"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "name the first word: a b c"},
     {"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "héllo wörld 🦙"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again\n\nand  again\t!"}],
]


def probe_strings() -> list[str]:
    """Plain text, whitespace runs, digits, non-ASCII, and the special tokens alone and inside text."""
    words = ["the quick brown fox", "  leading and trailing  ", "tabs\tand\nnewlines\n\n", "3 33 333 3.14159",
             "I've been 'told he's there", "héllo wörld", "中文字符", "🦙🚀 emoji", "a", "", "!!!???...",
             "reverse the words: alpha beta gamma", "Name the last word of: one two three"]
    words += SPECIALS + [f"x{s}y" for s in SPECIALS] + ["".join(SPECIALS), "<|user|>\nhi<|end|>\n<|assistant|>\n"]
    return words


def ids(path: str) -> dict:
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    out = {"transformers": transformers.__version__, "class": type(tok).__name__,
           "special": {s: tok.convert_tokens_to_ids(s) for s in SPECIALS},
           "bos_eos_pad": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
           "encode": [tok(s)["input_ids"] for s in probe_strings()],
           "encode_plain": [tok(s, add_special_tokens=False)["input_ids"] for s in probe_strings()],
           "decode": [tok.decode(tok(s)["input_ids"]) for s in probe_strings()]}
    if tok.chat_template:
        out["chat_text"] = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                            for c in CONVERSATIONS]
        out["chat_ids"] = [tok(t, add_special_tokens=False)["input_ids"] for t in out["chat_text"]]
    return out


def compare(other_python: str, paths: list[str]) -> int:
    bad = 0
    for path in paths:
        mine = ids(path)
        run = subprocess.run([other_python, __file__, path], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"FAIL {path}: {other_python} could not load it:\n{run.stderr.strip()[-2000:]}")
            bad += 1
            continue
        theirs = json.loads(run.stdout)
        diff = [k for k in mine if k not in ("transformers", "class") and mine[k] != theirs.get(k)]
        n = len(mine["encode"]) * 2 + len(mine.get("chat_ids", []))
        versions = f"transformers {mine['transformers']} ({mine['class']}) vs {theirs['transformers']} ({theirs['class']})"
        if diff:
            print(f"FAIL {path}: {versions}: differ in {diff}")
            bad += 1
        else:
            print(f"ok   {path}: {versions}: identical ids on {n} encodings "
                  f"({len(mine.get('chat_ids', []))} chat-template renderings), special tokens and decodes")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3:]))
    json.dump(ids(sys.argv[1]), sys.stdout)
