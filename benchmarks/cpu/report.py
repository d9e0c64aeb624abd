"""Goals, the one-line JSON summary and RESULTS.md's header and summary table, from the rows' result dicts (pure
formatting). The per-row sections and the page itself: report_details.py, which imports this module (never the
reverse)."""
from __future__ import annotations

import operator

# headline key -> (row that produces it, comparison, goal)
GOALS = {
    "throughput_ratio": ("throughput", ">=", 1.0),
    "packing_speedup": ("packing", ">=", 1.5),
    "merge_rss_growth": ("merge_rss", "<", 0.25),
    "estimate_error": ("estimate_error", "<=", 0.15),
}
_OPS = {">=": operator.ge, "<": operator.lt, "<=": operator.le}
# other figures worth a key of their own in the JSON summary: key -> (row, key in that row)
EXTRA = {"checkpointing_step_time_ratio": ("checkpointing", "step_time_ratio"),
         "checkpointing_flops_ratio": ("checkpointing", "flops_ratio"),
         "first_step_s": ("startup", "first_step_s"), "validate_70b_s": ("startup", "validate_70b_s"),
         "trl_tokens_per_s_ratio": ("trl_sft", "tokens_per_s_ratio"), "trl_peak_rss_ratio": ("trl_sft", "peak_rss_ratio"),
         "trl_loss_not_worse": ("trl_sft", "loss_not_worse"),
         "loss_memory_ratio": ("loss_memory", "loss_memory_ratio"),
         "load_rss_ratio_2_over_1": ("load_rss", "ratio_2_over_1"),
         "load_rss_single_over_model": ("load_rss", "single_growth_over_model"),
         "moe_speedup": ("moe_speedup", "moe_speedup"), "moe_peak_rss_ratio": ("moe_speedup", "peak_rss_ratio")}
LOADED = 0.5  # load average per core above which timings are flagged as taken under load


def status(row: dict | None) -> str:
    if row is None:
        return "not run"
    if "error" in row:
        return "error"
    if row.get("available") is False:
        return "not available"
    return "ok"


def goals(rows: dict) -> dict:
    """key -> {value, goal, met}; met is None when the row did not produce the figure."""
    out = {}
    for key, (row, op, target) in GOALS.items():
        value = rows.get(row, {}).get(key) if status(rows.get(row)) == "ok" else None
        out[key] = {"value": value, "goal": f"{op} {target}",
                    "met": None if value is None else bool(_OPS[op](value, target))}
    return out


def summary(results: dict) -> dict:
    """The object `--json` prints: headline figures first, then everything measured."""
    rows, g = results["rows"], goals(results["rows"])
    out = {k: v["value"] for k, v in g.items()}
    for key, (row, inner) in EXTRA.items():
        out[key] = rows.get(row, {}).get(inner)
    out["goals_met"] = {k: v["met"] for k, v in g.items()}
    out["all_goals_met"] = all(v["met"] for v in g.values())
    out["row_status"] = {name: status(r) for name, r in rows.items()}
    return {**out, "meta": results["meta"], "rows": rows}


def under_load(meta: dict) -> bool:
    """Whether other work was running when the benchmarks started. Only the load before counts: the one at
    the end is mostly the benchmarks' own 2-thread runs (measured: 1.1-1.4 after runs started at 0.1)."""
    cores = meta.get("machine", {}).get("cores") or 1
    before = meta.get("load_before")
    return before is not None and before / cores > LOADED


def _f(x, digits=3, unit=""):
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}{unit}"
    return f"{x}{unit}"


def _row_cell(rows: dict, name: str, text) -> str:
    st = status(rows.get(name))
    if st == "ok":
        return text()
    if st == "error":
        return f"error: {rows[name]['error']}"
    if st == "not available":
        return f"not available ({rows[name].get('reason', '')})"
    return "not run"


def summary_table(results: dict) -> str:
    rows, g = results["rows"], goals(results["rows"])
    mark = {True: "met", False: "NOT met", None: "-"}

    def goal_line(n, key, label, extra):
        v, row = g[key], GOALS[key][0]
        cell = _row_cell(rows, row, lambda: f"**{_f(v['value'])}** {extra()}")
        return f"| {n} | {label} (`{key}`) | {cell} | {v['goal']} | {mark[v['met']]} | {stamp(rows, row)} |"

    def line(n, label, row, text, goal="-"):
        return f"| {n} | {label} | {_row_cell(rows, row, text)} | {goal} | | {stamp(rows, row)} |"

    t, p, m, c, s, lm, ld, ph, pr = (rows.get(k, {}) for k in ("throughput", "packing", "merge_rss", "checkpointing",
                                                              "startup", "loss_memory", "load_rss", "phase_rss",
                                                              "prepare_rss"))
    return "\n".join([
        "| # | measure | result | goal | | measured |", "|---|---|---|---|---|---|",
        goal_line(1, "throughput_ratio", "finetune loop / plain loop, trained tokens/s",
                  lambda: f"({_f(t.get('finetune_tokens_per_s'), 4)} vs {_f(t.get('plain_tokens_per_s'), 4)})"),
        goal_line(2, "packing_speedup", "packed / unpacked, trained tokens/s",
                  lambda: f"(padding {_f(p.get('padding_fraction_packed'), 2)} packed, "
                          f"{_f(p.get('padding_fraction_unpacked'), 2)} unpacked)"),
        goal_line(3, "merge_rss_growth", "peak RSS per extra model byte, `finetune merge`",
                  lambda: f"(peft merge_and_unload: {_f(m.get('peft_rss_growth'))})"),
        goal_line(4, "estimate_error", "worst relative error of the planner, tiny model", lambda: ""),
        line(5, "checkpointing on / off, step time", "checkpointing",
             lambda: f"**{_f(c['step_time_ratio'])}x** ({_f(c['s_per_step']['on'])} s vs {_f(c['s_per_step']['off'])} s)"),
        line(5, "FLOPs per token, counted / rule", "checkpointing",
             lambda: f"off: {_f(c['flops']['off']['vs_rule'])} x 4N; on: {_f(c['flops']['on']['vs_rule'])} x 6N"),
        line(6, "time to first step, tiny recipe", "startup", lambda: f"**{_f(s['first_step_s'])} s**"),
        line(6, "`validate` of the 70B recipe", "startup", lambda: f"**{_f(s['validate_70b_s'])} s**"),
        line(7, "finetune / TRL SFTTrainer: tokens/s, peak RSS; held-out loss not worse", "trl_sft",
             lambda: trl_cell(rows["trl_sft"]), ">= 1.1, <= 1.0, yes"),
        line(8, "loss path peak bytes, full logits / chunked (128k vocab, 4096 tokens)", "loss_memory",
             lambda: f"**{_f(lm['loss_memory_ratio'])}x** (chunked planned within "
                     f"{_f(100 * abs(lm['chunked']['plan_error']), 2)}%)"),
        line(9, "loading, peak RSS growth per process: 2 FSDP / 1 process; 1 process / model bytes", "load_rss",
             lambda: f"**{_f(ld['ratio_2_over_1'])}**; **{_f(ld['single_growth_over_model'])}**", "<= 0.6; <= 1.5"),
        line(10, "whole run, 2 FSDP2 ranks: what a rank saves over one process, in packed 4-bit bytes", "phase_rss",
             lambda: f"**{_f(ph['fsdp2_saving_over_packed'])}x**", ">= 0.4"),
        line(11, "`finetune data`, peak RSS on a cold cache", "prepare_rss",
             lambda: f"**{_f(pr['peak_rss_gib'])} GiB** for {pr['rows_written']:,} rows"),
        line(12, "MoE, grouped 4-bit experts / per-expert loop: tokens/s; peak RSS", "moe_speedup",
             lambda: f"**{_f(rows['moe_speedup']['moe_speedup'])}x**; {_f(rows['moe_speedup']['peak_rss_ratio'])}",
             ">= 10; <= 1.0")])


def stamp(rows: dict, name: str) -> str:
    """The commit and date a row was measured at (and 'quick' for a --quick run): rows are kept across runs of
    some rows, so each one says how old it is."""
    m = (rows.get(name) or {}).get("measured")
    if not m:
        return "-"
    return f"`{m['commit']}` {str(m['date'])[:10]}" + (" (quick)" if m.get("quick") else "")


def trl_cell(r: dict) -> str:
    return (f"**{_f(r['tokens_per_s_ratio'])}x**, **{_f(r['peak_rss_ratio'])}x**, "
            f"**{'yes' if r['loss_not_worse'] else 'no'}**")


def header(results: dict) -> str:
    meta = results["meta"]
    m, v = meta["machine"], meta["versions"]
    lines = ["# Benchmarks", "",
             f"Last command: `{meta['command']}` on {meta['date']}, commit `{meta['commit']}`, "
             f"{_f(meta.get('seconds'), 4)} s in all; it measured {', '.join(meta.get('rows_run') or []) or 'no row'}. "
             "Every row says the commit and date it was measured at (the summary's `measured` column, and under "
             "each section's title); a row the last command did not run keeps its earlier figures and stamp. "
             "Regenerate: `python -m benchmarks` (all rows, about an hour on 2 cores) or `--rows a,b`. The raw "
             "results are in RESULTS.json beside this file.", ""]
    if meta.get("partial"):
        lines += [f"> **Partial**: {meta['partial']}; the run was stopped or is still going, so rows marked "
                  "'not run' have no figures yet.", ""]
    if meta.get("quick"):
        lines += ["> **Quick run** (`--quick`): fewer repetitions and steps than the record needs; do not quote.", ""]
    if under_load(meta):
        lines += [f"> **Taken under load**: load average {meta.get('load_before')} at the start on "
                  f"{m.get('cores')} cores; other processes competed for the CPU, so the timings (rows 1, 2, 5, "
                  "6) are not final. Rerun on an idle machine.", ""]
    lines += ["| machine | |", "|---|---|",
              f"| CPU | {m.get('cpu')} ({m.get('cores')} cores) |", f"| memory | {m.get('memory_gib')} GiB |",
              f"| OS | {m.get('os')} |", f"| torch threads | {meta.get('threads') or 'default'} |",
              "| versions | " + ", ".join(f"{k} {val}" for k, val in v.items()) + " |", ""]
    return "\n".join(lines)
