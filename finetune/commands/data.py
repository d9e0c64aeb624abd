"""`finetune data RECIPE`: look at exactly what trains, before training.

Renders N examples with the trained tokens marked (labels != -100), then the counts: rows, bad rows,
truncated/dropped, tokens, trained tokens, packing efficiency and padding, and for chats whether every trained
turn has exactly the tokens inference renders for it. Loads the tokenizer only.
With --json the last line is one JSON object of the stats.
"""
from __future__ import annotations

import json
import sys

from finetune.commands.common import add_recipe_arguments
from finetune.data.chat import IGNORE
from finetune.data.explain import data_notes
from finetune.util.errors import RecipeError

OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦trained⟧ when the output is not a terminal
GREEN, RESET = "\033[1;32m", "\033[0m"


def tokenizer_for(model_spec):
    """The recipe's tokenizer. For the builtin model only its tokenizer files are needed, so the shipped
    ones are read directly (never building or loading weights just to look at data)."""
    from finetune.weights.load.resolve import load_tokenizer
    from finetune.util import builtin as tiny

    shipped = tiny.ASSETS / f"tiny-llama-{tiny.VERSION}"
    if model_spec.name in tiny.BUILTIN_MODELS and (shipped / "tokenizer.json").exists():
        return load_tokenizer(model_spec, path=str(shipped))
    return load_tokenizer(model_spec)


def render(example: dict, tok, color: bool) -> str:
    """The example's text with trained spans marked. A token trains when its label is not -100 and it
    is not the first (the shifted loss never predicts token 0). Runs are decoded whole so multi-byte
    characters split across tokens still read correctly."""
    ids = example["input_ids"]
    trained = [i > 0 and lab != IGNORE for i, lab in enumerate(example["labels"])]
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = _decode(tok, ids[start:i])
            if trained[start]:
                text = (GREEN + text + RESET) if color else (OPEN + text + CLOSE)
            out.append(text)
            start = i
    return "".join(out)


def _decode(tok, ids: list[int]) -> str:
    """Decoded text; ids the tokenizer does not have (pre-tokenized or synthetic rows for a model with a
    larger vocabulary) show as <id N>, where decode would drop them silently."""
    size, out, run = len(tok), [], []
    for t in ids:
        if t < size:
            run.append(t)
            continue
        out += [tok.decode(run), f"<id {t}>"]
        run = []
    return "".join(out) + tok.decode(run)


def summary(stats: dict, data_spec) -> list[str]:
    s = stats
    pct = 100 * s["trained_tokens"] / max(s["tokens"], 1)
    lines = ["sources:"]
    for src in s["sources"]:
        lines.append(f"  {src['path']}  ({src['format']}, weight {src['weight']:g}): {src['rows_read']} rows read, "
                     f"{src['rows_eval']} held out, {src['rows_train']} to train")
    lines += [
        f"rows: {s['rows']} train, {s['eval_rows']} eval; bad rows skipped: {s['rows_skipped']}",
        f"length: kept examples max {s['max_length']}, mean {s['mean_length']} tokens; before max_seq_len "
        f"{data_spec.max_seq_len}: longest {s['longest_example']}, 99% within {s['max_seq_len_99pct']}; "
        f"{s['truncated']} truncated, {s['dropped_overlong'] + s['prompt_fills_max_seq_len']} dropped for length, "
        f"{s['no_trained_tokens']} with nothing to train",
        f"tokens: {s['tokens']}, trained: {s['trained_tokens']} ({pct:.1f}%)",
        f"packing ({'on' if data_spec.packing else 'off'}, layout {s['packing_layout'] or 'padded'}): "
        f"efficiency {s['packing_efficiency']:.3f} over {s['packed_rows']} rows of {data_spec.max_seq_len}; "
        f"padding per micro-batch of {s['micro_batch_size']}: {100 * s['padding_fraction_unpacked']:.1f}% unpacked, "
        f"{100 * s['padding_fraction_packed']:.1f}% packed",
    ]
    infos, warns = data_notes(data_spec, s)
    lines += infos + [f"warning: {w}" for w in warns]
    lines += chat_lines(s)
    if s["bad_rows"]:
        lines.append(f"bad rows (first {len(s['bad_rows'])} of {s['rows_skipped']}):")
        lines += [f"  {b}" for b in s["bad_rows"]]
    return lines


def chat_lines(s: dict) -> list[str]:
    """The inference-rendering check of the chat turns (data/chat.py), when the data has chats."""
    if not (s.get("chat_turns_checked") or s.get("chat_rows_split")):
        return []
    same = s["chat_turns_checked"] - s["chat_turns_differing"]
    lines = [f"chat turns: {same} of {s['chat_turns_checked']} trained turns have exactly the tokens inference "
             f"renders for the conversation before them (add_generation_prompt) and through them"]
    if s["chat_rows_split"]:
        lines.append(f"  {s['chat_rows_split']} rows: the template rewrites earlier turns (e.g. drops their "
                     f"reasoning), so they train as {s['chat_split_examples']} examples: a turn that a later turn's "
                     "rendering rewrites trains in an example of its own")
    if s["chat_differing"]:
        lines.append(f"  differing (first {len(s['chat_differing'])} of {s['chat_turns_differing']}):")
        lines += [f"    {d}" for d in s["chat_differing"]]
    return lines


def example_header(i: int, ex: dict, total: int) -> str:
    n_trained = sum(t != IGNORE for t in ex["labels"][1:])
    head = f"--- example {i + 1} of {total} ({ex.get('where', '?')}): {len(ex['input_ids'])} tokens, {n_trained} trained"
    if ex.get("parts", 1) > 1:
        head += f"; one of {ex['parts']} examples of its row (the template rewrites history)"
    if ex.get("turns"):
        head += (f"\ncheck: MISMATCH {ex['check']}" if ex["check"] else
                 f"\ncheck: {ex['turns']} trained turn(s) equal the inference rendering of their prefix")
    return head


def register(sub) -> None:
    p = sub.add_parser("data", help="look at what trains", description="Show what trains: examples with the "
                       "trained tokens marked, and the data stats.")
    add_recipe_arguments(p)
    p.add_argument("--dataset", help="use this one file or folder instead of the recipe's sources (format detected)")
    p.add_argument("--show", type=int, default=3, metavar="N", help="examples to render (default 3)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the stats")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.set_defaults(run=run)


def run(args) -> int:
    from finetune.commands.common import load_recipe
    from finetune.plan.archs import vocab_size
    from finetune.recipe import DataSource
    from finetune.train.preflight import refuse_remote_code

    if args.show < 0:
        raise RecipeError(["--show: must be >= 0"])
    recipe = load_recipe(args)
    refuse_remote_code(recipe)  # a config that asks for its own code: one line, not transformers' traceback
    # torch only now: a bad recipe or argument is refused at once
    from finetune.data.batching import batch_stats, packing_layout
    from finetune.data.prepare import prepare
    from finetune.weights.load.resolve import resolve_attention

    if args.dataset:
        recipe.data.sources = [DataSource(path=args.dataset)]
        recipe.data.eval_sources = []
    tok = tokenizer_for(recipe.model)
    prepared = prepare(recipe.data, tok, vocab_size(recipe.model.name))
    stats = dict(prepared.stats)
    stats.update(batch_stats(prepared.train, recipe.train.micro_batch_size, recipe.data.max_seq_len))
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    # Their notices (flash-attn missing, packing unsupported) print here, after the data is ready.
    attn = resolve_attention(recipe.model.attn_implementation)
    layout = packing_layout(recipe.data.packing, attn)
    stats.update(packing=recipe.data.packing, packing_layout=layout, micro_batch_size=recipe.train.micro_batch_size)
    if args.show:
        print(f"trained tokens are shown {'in green' if color else OPEN + 'like this' + CLOSE}")
    for i, ex in enumerate(prepared.train[: args.show]):
        print(example_header(i, ex, len(prepared.train)))
        print(render(ex, tok, color))
        if "rejected_ids" in ex:  # a preference pair: its rejected side, scored the same way
            print("rejected:\n" + render({"input_ids": ex["rejected_ids"], "labels": ex["rejected_labels"]}, tok, color))
    print("---")
    print("\n".join(summary(stats, recipe.data)))
    if args.json:
        print(json.dumps(stats, default=str))
    return 0
