"""Builtin assets the project makes itself, so nothing is downloaded: a tiny Llama and a synthetic
instruction set. `builtin:tiny-llama` and `builtin:tiny-instruct` in a recipe resolve here.

The model is a small Llama (GQA, RoPE, SwiGLU: the real architecture, scaled down) with a
byte-level BPE tokenizer trained on the synthetic corpus. The tasks (reverse the words, or name the first, second
or last) are quick to learn with LoRA and hard to guess, so learning is plain to see in loss and exact match.

Everything is deterministic and written atomically (build in a temp dir, then rename), so several ranks
building at once is safe.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from finetune.util.errors import RecipeError

VERSION = "v4"  # bump when the builder changes: a new cache directory, never a stale mix
WORDS = ("red blue green black white pink gold gray cat dog fox owl bee cow pig ant sun moon star rain "
         "snow wind tree rock lake hill road ship car bus one two six ten").split()
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '<|end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def cache_root() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune"))


def atomic_build(target: Path, build) -> Path:
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; theirs is identical
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


TASKS = {
    "reverse": lambda w: w[::-1],
    "first": lambda w: w[:1],
    "second": lambda w: w[1:2],
    "last": lambda w: w[-1:],
}


def _example(rng: random.Random) -> dict:
    words = rng.sample(WORDS, rng.randint(3, 5))
    task = rng.choice(sorted(TASKS))
    return {"prompt": f"{task}: {' '.join(words)}\n", "completion": " ".join(TASKS[task](words))}


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [_example(rng) for _ in range(n)]


def dataset_dir() -> Path:
    """builtin:tiny-instruct: train.jsonl (4000 rows) and eval.jsonl (200 rows, no prompt shared with train)."""

    def build(tmp: Path):
        rows = make_rows(4600, seed=1234)
        held = list({r["prompt"]: r for r in rows[:220]}.values())[:200]
        held_prompts = {r["prompt"] for r in held}
        # Hold out by prompt, so eval measures generalisation, not recall.
        train = [r for r in rows[220:] if r["prompt"] not in held_prompts][:4000]
        for name, part in (("train", train), ("eval", held)):
            with open(tmp / f"{name}.jsonl", "w") as f:
                for r in part:
                    f.write(json.dumps(r) + "\n")

    return atomic_build(cache_root() / f"tiny-instruct-{VERSION}", build)


# builtin:tiny-preference: the rejected answer is a plausible mistake, the answer of a neighbouring task on the
# same words, so a pair differs only in what the instruction asked for.
WRONG = {
    "reverse": lambda w: w,  # the words as given, not reversed
    "first": lambda w: w[1:2],
    "second": lambda w: w[:1],
    "last": lambda w: w[-2:-1],
}


PREFERENCE_VERSION = 2  # bump when the preference set changes (2: all 4000 training rows, not 1000)


def preference_row(row: dict) -> dict:
    """A tiny-instruct row as a preference pair: chosen = its right answer, rejected = WRONG's."""
    task, words = row["prompt"].split(":", 1)
    return {"prompt": row["prompt"], "chosen": row["completion"], "rejected": " ".join(WRONG[task](words.split()))}


def preference_dir() -> Path:
    """builtin:tiny-preference: train.jsonl (4000 pairs, from tiny-instruct's training rows) and eval.jsonl (the
    200 held-out prompts of tiny-instruct's eval split, so an SFT run on tiny-instruct never saw them)."""
    source = dataset_dir()

    def build(tmp: Path):
        for name, limit in (("train", 4000), ("eval", 200)):
            rows = [json.loads(line) for line in (source / f"{name}.jsonl").read_text().splitlines()[:limit]]
            with open(tmp / f"{name}.jsonl", "w") as f:
                for r in rows:
                    f.write(json.dumps(preference_row(r)) + "\n")

    return atomic_build(cache_root() / f"tiny-preference-{VERSION}-{PREFERENCE_VERSION}", build)


ASSETS = Path(__file__).parent / "assets"
def model_dir() -> Path:
    """builtin:tiny-llama: 4 layers, hidden 256, GQA 4/2 heads, ~2.6M parameters, shipped in the package
    (finetune/util/assets; scripts/build_tiny_llama.py built it)."""
    shipped = ASSETS / f"tiny-llama-{VERSION}"
    if not (shipped / "model.safetensors").exists():  # a checkout or install without the package data
        raise RecipeError([f"model.name: builtin:tiny-llama is missing from {shipped}; reinstall finetune, or "
                           "rebuild it with `python scripts/build_tiny_llama.py`"])
    return shipped


BUILTIN_MODELS = {"builtin:tiny-llama": model_dir}
BUILTIN_DATASETS = {"builtin:tiny-instruct": dataset_dir, "builtin:tiny-preference": preference_dir}


def builtin_dir(name: str, what: str = "model.name", kind: str = "model") -> Path:
    """The local directory of a builtin model (`builtin:tiny-llama`) or, with kind="dataset", a builtin dataset
    (`builtin:tiny-instruct`), built on first use. RecipeError naming `what` and the known names otherwise."""
    table = BUILTIN_DATASETS if kind == "dataset" else BUILTIN_MODELS
    builder = table.get(name)
    if builder is None:
        noun = "builtin dataset" if kind == "dataset" else "builtin"
        raise RecipeError([f"{what}: unknown {noun} '{name}'; known: {', '.join(table)}"])
    return builder()
