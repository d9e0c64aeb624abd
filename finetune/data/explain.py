"""Data that explains itself: where the held-out rows come from (and a warning when they are not the
training data), and what the length policy did, by reason, with the max_seq_len that would fix it. Pure
functions over a DataSpec and prepare()'s stats: the run's first lines, `finetune data` and the errors use them.
"""
from __future__ import annotations

import math
from pathlib import Path

from finetune.recipe import DataSpec


def _name(src) -> str:
    return src.path + (f" (split {src.split})" if src.split != "train" else "")


def data_notes(spec: DataSpec, stats: dict) -> tuple[list[str], list[str]]:
    """(lines to print, warnings): the training and held-out sources, and the length policy's drops."""
    train = ", ".join(_name(s) for s in spec.sources)
    if spec.eval_sources:
        held = f"data.eval_sources {', '.join(_name(s) for s in spec.eval_sources)}"
    elif spec.eval_split > 0:
        held = f"data.eval_split {spec.eval_split:g} of the training rows (never trained)"
    else:
        held = "none (data.eval_split 0, no data.eval_sources)"
    infos = [f"data: training on {train}; held out for eval: {held}, {stats.get('eval_rows', 0)} examples"]
    layout = stats.get("prompt_layout")
    if layout == "chat":
        infos.append(f"data: instruction and prompt/completion rows train as a user and an assistant turn of the chat "
                     f"template (data.prompt_template: {spec.prompt_template}; `raw` trains them as plain text)")
    elif layout == "raw":
        infos.append(f"data: instruction and prompt/completion rows train as plain text, the prompt then the completion "
                     f"(data.prompt_template: {spec.prompt_template}"
                     + ("; the tokenizer has no chat template)" if spec.prompt_template == "auto" else ")"))
    warns = []
    other = sorted({s.path for s in spec.eval_sources} - {s.path for s in spec.sources})
    if other:
        warns.append(f"data.eval_sources: {', '.join(other)} is not the training data ({train}): eval_loss and "
                     "exact match score other rows than the ones you train on. To hold out your own rows, remove "
                     "data.eval_sources (data.eval_split of them is held out)")
    same = sorted({s.path for s in spec.eval_sources} & {s.path for s in spec.sources if Path(s.path).exists()})
    if same:
        warns.append(f"data.eval_sources: {', '.join(same)} is a local training file, read whole whatever its "
                     "split: the held-out rows are training rows. Remove data.eval_sources to hold out "
                     "data.eval_split of them, or name a file of held-out rows")
    warns += [f"{line}" for line in length_lines(stats, spec.max_seq_len)]
    return infos, warns


def length_figures(lengths) -> dict:
    """The longest example's tokens and the max_seq_len that keeps 99% of the examples whole (`lengths`: a
    sequence of ints; sorted as one numpy array, so millions of them stay a few bytes each)."""
    import numpy as np

    ordered = np.sort(np.asarray(lengths, dtype=np.int64))
    p99 = int(ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]) if len(ordered) else 0
    return {"longest_example": int(ordered[-1]) if len(ordered) else 0, "max_seq_len_99pct": p99}


def length_lines(counts: dict, max_seq_len: int) -> list[str]:
    """What the length policy did, by reason, with the fix; no line when it did nothing."""
    c, lines = counts, []
    if c["prompt_fills_max_seq_len"]:
        lines.append(f"data.max_seq_len: {c['prompt_fills_max_seq_len']} examples dropped: their prompt fills all "
                     f"{max_seq_len} tokens, so nothing was left to train after truncation")
    if c["dropped_overlong"]:
        lines.append(f"data.max_seq_len: {c['dropped_overlong']} examples longer than {max_seq_len} tokens dropped "
                     "(data.overlong: drop)")
    if c["truncated"]:
        lines.append(f"data.max_seq_len: {c['truncated']} examples longer than {max_seq_len} tokens truncated")
    if c["no_trained_tokens"]:
        lines.append(f"data: {c['no_trained_tokens']} examples dropped with no token to train (no completion or "
                     "assistant turn)")
    if c.get("identical_pairs"):
        lines.append(f"data: {c['identical_pairs']} preference pairs dropped: chosen equals rejected (as trained, within "
                     f"{max_seq_len} tokens), so a preference method learns nothing from them")
    if lines and c["longest_example"] > max_seq_len:
        lines.append(f"the longest example has {c['longest_example']} tokens; data.max_seq_len="
                     f"{c['max_seq_len_99pct']} keeps 99% of them whole (or shorten the prompts)")
    return lines


