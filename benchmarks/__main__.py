"""`python -m benchmarks [--json]`: the CPU rows, each in a fresh interpreter, then benchmarks/RESULTS.md.

Rows (one module each, benchmarks/README.md has the table): throughput (1), packing (2), merge_rss (3),
estimate_error (4), checkpointing (5), startup (6), trl_sft (7), loss_memory (8), load_rss (9), phase_rss (10),
prepare_rss (11), moe_speedup (12). Every row is stamped with the commit and date it was measured at, and kept in
benchmarks/RESULTS.json: a run of some rows (`--rows`) rewrites those and keeps the others with their own
stamps, so a stale row says so. With --json the last line of stdout is one JSON object: the four goal figures
first, then everything measured. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.cpu import report, report_details

# row -> (kwargs for the record, kwargs for --quick, timeout in seconds). The record settings keep the
# whole run near 8 minutes on 2 idle cores.
ROWS = {
    "throughput": ({"reps": 5, "warmup": 5, "steps": 20}, {"reps": 1, "warmup": 2, "steps": 2}, 900),
    "packing": ({}, {}, 600),
    "merge_rss": ({"reps": 3}, {"reps": 1}, 600),
    "estimate_error": ({}, {}, 600),
    "checkpointing": ({"reps": 5, "warmup": 5, "steps": 10}, {"reps": 1, "warmup": 2, "steps": 2}, 900),
    "startup": ({"first_step_reps": 3, "validate_reps": 5}, {"first_step_reps": 1, "validate_reps": 1}, 600),
    "trl_sft": ({"seeds": [1, 2, 3], "steps": 150}, {"seeds": [1], "steps": 4, "window": 2}, 1200),
    "loss_memory": ({}, {}, 900),
    "load_rss": ({}, {"layers": 4}, 1800),
    "phase_rss": ({}, {"layers": 2, "only": ["single", "fsdp2"]}, 3600),
    "prepare_rss": ({"rows": 200_000}, {"rows": 20_000}, 1800),
    "moe_speedup": ({"reps": 3, "warmup": 2, "steps": 6}, {"reps": 1, "warmup": 1, "steps": 2}, 1800),
}
# row -> the module that measures it (run through benchmarks._child): the peer comparison lives with the peers
MODULES = {name: f"{'peers' if name.startswith('trl_') else 'cpu'}.{name}" for name in ROWS}
DEFAULT_OUT = common.ROOT / "benchmarks" / "RESULTS.md"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    ap.add_argument("--rows", help=f"comma-separated subset of: {', '.join(ROWS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewest repetitions and steps: for trying the harness, "
                    "not for the record (RESULTS.md says so)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every measurement (default: torch's own "
                    "choice, one per core)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the markdown report")
    ap.add_argument("--check", action="store_true", help="exit 1 unless all four goals are met")
    ap.add_argument("--fresh", action="store_true", help="forget the rows kept from earlier runs (the JSON "
                    "beside --out): the report then holds only the rows run now")
    a = ap.parse_args(argv)
    a.selected = list(ROWS) if not a.rows else [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in a.selected if r not in ROWS]
    if unknown or not a.selected:
        ap.error(f"unknown row(s) {', '.join(unknown) or '(none given)'}; rows are: {', '.join(ROWS)}")
    if a.threads is not None and a.threads < 1:
        ap.error("--threads must be at least 1")
    return a


def meta(a: argparse.Namespace, argv: list[str]) -> dict:
    return {"command": " ".join(["python -m benchmarks", *argv]), "date": common.now(), "commit": common.commit(),
            "machine": common.machine(), "versions": common.versions(), "quick": a.quick,
            "threads": a.threads, "load_before": common.load_average(), "rows_run": a.selected}


def run_rows(a: argparse.Namespace, results: dict, t0: float,
             log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    rows = results["rows"] = {} if a.fresh else kept_rows(a.out)
    stamp = {k: results["meta"][k] for k in ("commit", "date", "quick", "threads")}
    for i, name in enumerate(a.selected, 1):
        full, quick, timeout = ROWS[name]
        log(f"benchmarks: {name} ...")
        rows[name] = common.run_module(MODULES[name], quick if a.quick else full, timeout, a.threads)
        rows[name]["measured"] = stamp
        log(f"benchmarks: {name}: {report.status(rows[name])} ({rows[name].get('seconds', '?')} s)")
        if i < len(a.selected):
            # A full run takes most of an hour: the report is rewritten after every row, so stopping the run
            # keeps every figure measured so far (marked partial).
            results["meta"].update(seconds=round(time.perf_counter() - t0, 1),
                                   partial=f"{i} of {len(a.selected)} rows measured")
            write_report(a, results)
    results["meta"].pop("partial", None)
    return rows


def kept_rows(out: Path) -> dict:
    """The rows an earlier run measured (RESULTS.json beside the report), in the table's order, each with its
    own `measured` stamp; rows from before the stamps existed are dropped rather than shown undated."""
    raw = out.with_suffix(".json")
    old = json.loads(raw.read_text()).get("rows", {}) if raw.exists() else {}
    return {name: old[name] for name in ROWS if "measured" in old.get(name, {})}


def write_report(a: argparse.Namespace, results: dict) -> None:
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    a.out.write_text(report_details.markdown(results))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    t0 = time.perf_counter()
    results = {"meta": meta(a, argv)}
    run_rows(a, results, t0)
    results["meta"].update(seconds=round(time.perf_counter() - t0, 1), load_after=common.load_average())
    write_report(a, results)
    print(report.summary_table(results))
    print(f"\nwrote {a.out}")
    s = report.summary(results)
    if a.json:
        print(json.dumps(s, default=str))
    failed = [n for n in a.selected if s["row_status"][n] == "error"]  # a kept row's old error is not this run's
    if failed:
        print(f"benchmarks: failed rows: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 1 if a.check and not s["all_goals_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
