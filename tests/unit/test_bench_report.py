"""`python -m benchmarks`: argument handling, goals, RESULTS.md and the JSON last line, on given row results.
(No timing here: the rows' measurements are what the command itself runs.)"""
import json

import pytest

from benchmarks import __main__ as cli
from benchmarks import common
from benchmarks.cpu import report, report_details

ROWS = {
    "throughput": {"throughput_ratio": 1.08, "finetune_tokens_per_s": 520.0, "plain_tokens_per_s": 481.5,
                   "finetune_s_per_step": 0.11, "plain_s_per_step": 0.12, "pair_ratios": [1.1, 1.05, 1.08],
                   "samples": {"finetune": [510.0, 520.0, 530.0], "plain": [480.0, 481.5, 490.0],
                               "finetune_torch_kernels": [470.0, 475.0, 480.0]},
                   "torch_kernels_ratio": 0.986, "reps": 3,
                   "warmup_steps": 5, "timed_steps": 20, "threads": 2,
                   "first_loss": {"finetune": 2.331234, "plain": 2.3312341}},
    "packing": {"packing_speedup": 2.1, "padding_fraction_packed": 0.02, "padding_fraction_unpacked": 0.55},
    "merge_rss": {"merge_rss_growth": 0.04, "peft_rss_growth": 1.02, "model_bytes": {"small": 2e8, "large": 4e8},
                  "peak_rss_bytes": {"finetune": {"small": 5e8, "large": 5.1e8},
                                     "peft": {"small": 9e8, "large": 1.1e9}}, "shard_bytes": 10**8},
    "estimate_error": {"estimate_error": 0.016, "rows": [{"what": "lora", "planned": 10, "measured": 10, "error": 0.0}]},
    "checkpointing": {"step_time_ratio": 1.3, "s_per_step": {"off": 0.1, "on": 0.13}, "flops_ratio": 1.48,
                      "samples": {"off": [0.1], "on": [0.13]}, "reps": 1, "warmup_steps": 5, "timed_steps": 10,
                      "flops": {m: {"flops_per_token": f, "rule": r, "rule_name": n, "vs_rule": f / r, "model": f,
                                    "vs_model": 1.0, "N": 100, "L": 10, "by_op_per_token": {"aten.mm": f}}
                                for m, f, r, n in (("off", 480.0, 400, "4N"), ("on", 710.0, 600, "6N"))}},
    "startup": {"first_step_s": 9.5, "validate_70b_s": 1.2, "samples": {"first_step_s": [9.5],
                                                                          "validate_70b_s": [1.2]}},
    "trl_sft": {"available": False, "reason": "trl is not installed"},  # its own figures: test_bench_trl.py
    "loss_memory": {"tokens": 4096, "vocab": 128256, "precision": "no", "loss_memory_ratio": 23.1, "same_loss": True,
                    "chunked": {"measured_bytes": 2.73e8, "planned_bytes": 2.70e8, "plan_error": -0.009, "loss": 1.0},
                    "full": {"measured_bytes": 6.31e9, "planned_bytes": 6.30e9, "plan_error": -0.001, "loss": 1.0}},
    "load_rss": {"model": "synthetic:x", "checkpoint_bytes": 2.14e9, "FSDP2 x2 ratio": 0.62, "FSDP1 x2 ratio": 0.81,
                 "ratio_2_over_1": 0.81, "single_growth_over_model": 0.99, "plan_error": 0.14,
                 "runs": {"1 process": {"planned_reader": 6.5e8, "ranks": [{"rank": 0, "growth": 5.96e8,
                                                                             "held_bytes": 6.0e8}]}}},
    "phase_rss": {"model": "synthetic:y", "packed_4bit_gib": 0.453, "runs": ["single", "fsdp2"],
                  "single": {"growth_gib": {"load": [1.77], "steps": [2.47]}, "plan_gib": {"load": 3.48, "steps": 1.5}},
                  "fsdp2": {"growth_gib": {"load": [0.31, 0.32], "steps": [2.84, 3.01]},
                            "plan_gib": {"load": 3.11, "steps": 1.5}},
                  "whole_run_growth_gib": {"single": 2.47, "fsdp2": 3.01}, "fsdp2_saving_over_packed": -1.19},
    "prepare_rss": {"rows_written": 200000, "rows": 198000, "eval_rows": 2000, "peak_rss_gib": 0.61,
                    "cold_seconds": 120.0, "warm_peak_rss_gib": 0.6, "warm_seconds": 60.0},
    "moe_speedup": {"moe_speedup": 3.16, "peak_rss_ratio": 0.85},
}


def results(rows=None, **meta):
    m = {"command": "python -m benchmarks --json", "date": "2026-11-22", "commit": "abc123", "seconds": 400.0,
         "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 24.0, "os": "Linux"}, "quick": False,
         "versions": {"torch": "2.13.0"}, "threads": None, "load_before": 0.1, "load_after": 0.2}
    return {"meta": {**m, **meta}, "rows": dict(ROWS if rows is None else rows)}


def test_rows_option():
    assert cli.parse_args([]).selected == list(cli.ROWS)
    assert cli.parse_args(["--rows", "startup, throughput"]).selected == ["startup", "throughput"]


@pytest.mark.parametrize("args", [["--rows", "throughput,speed"], ["--rows", ","], ["--threads", "0"],
                                  ["--bogus"]])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(args)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_record_settings_meet_the_issue():
    # interleaved A/B rows take the median of at least 5 runs each in the recorded (non-quick) run
    for name in ("throughput", "checkpointing"):
        assert cli.ROWS[name][0]["reps"] >= 5


def test_goals_met_missed_and_absent():
    g = report.goals(results()["rows"])
    assert all(v["met"] for v in g.values())
    g = report.goals({**ROWS, "throughput": {**ROWS["throughput"], "throughput_ratio": 0.97},
                      "merge_rss": {**ROWS["merge_rss"], "merge_rss_growth": 0.25},
                      "packing": {"available": False, "reason": "absent"}, "estimate_error": {"error": "exit 1"}})
    assert g["throughput_ratio"]["met"] is False and g["merge_rss_growth"]["met"] is False  # the goal is < 0.25
    assert g["packing_speedup"] == {"value": None, "goal": ">= 1.5", "met": None}
    assert g["estimate_error"]["met"] is None


def test_summary_leads_with_the_goal_figures():
    s = report.summary(results())
    assert list(s)[:4] == ["throughput_ratio", "packing_speedup", "merge_rss_growth", "estimate_error"]
    assert s["all_goals_met"] is True and s["first_step_s"] == 9.5 and s["checkpointing_step_time_ratio"] == 1.3
    assert json.loads(json.dumps(s))["rows"]["startup"]["validate_70b_s"] == 1.2


def test_markdown_has_machine_versions_commit_and_every_row():
    md = report_details.markdown(results())
    for text in ("Test CPU (2 cores)", "torch 2.13.0", "commit `abc123`", "**1.08** (520 vs 481.5)",
                 "**2.1** (padding 0.02 packed, 0.55 unpacked)", "(peft merge_and_unload: 1.02)", "**0.016**",
                 "**1.3x**", "2.331234 for finetune", "off: 1.2 x 4N; on: 1.18 x 6N", "**9.5 s**", "**1.2 s**", "4N", "6N"):
        assert text in md, text
    assert md.count("| met |") == 4
    assert "Taken under load" not in md and "Quick run" not in md
    for n in range(1, 7):
        assert f"## {n}. " in md


def test_markdown_flags_load_quick_runs_and_failures():
    rows = {**ROWS, "packing": {"available": False, "reason": "benchmarks/cpu/packing.py is not present"},
            "merge_rss": {"error": "exit 1", "stderr": "Traceback ...\nMemoryError"}}
    rows.pop("startup")
    md = report_details.markdown(results(rows, load_before=3.9, quick=True))
    assert "Taken under load" in md and "load average 3.9" in md and "not final" in md
    assert "Quick run" in md
    # the load at the end is the benchmarks' own: it does not flag an idle start
    assert "Taken under load" not in report_details.markdown(results(ROWS, load_before=0.1, load_after=1.4))
    assert "not available (benchmarks/cpu/packing.py is not present)" in md
    assert "error: exit 1" in md and "MemoryError" in md
    assert "Not run this time" in md  # startup


def test_a_row_missing_a_figure_does_not_break_the_report():
    rows = {**ROWS, "packing": {"packing_speedup": 1.7}}  # another module's result shape may change
    md = report_details.markdown(results(rows))
    assert "**1.7**" in md and "## 2. Packing" in md


def test_steady_rate_skips_the_warmup_window():
    recs = [{"step": 1, "time": 0.2, "tokens_per_s": 5.0}, {"step": 5, "time": 1.0, "tokens_per_s": 50.0},
            {"step": 5, "time": 1.1, "eval_loss": 2.0}, {"step": 10, "time": 2.0, "tokens_per_s": 100.0},
            {"step": 15, "time": 4.0, "tokens_per_s": 40.0}]
    r = common.steady_rate(recs, after_step=5)
    assert r["tokens_per_s"] == pytest.approx((100 * 1 + 40 * 2) / 3)
    assert r["s_per_step"] == pytest.approx(3 / 10) and r["steps"] == 10
    with pytest.raises(ValueError):
        common.steady_rate(recs, after_step=15)


def test_last_json_line_ignores_library_chatter():
    assert common.last_json_line('warning: x\n{"a": 1}\n{not json\n') == {"a": 1}
    with pytest.raises(ValueError):
        common.last_json_line("nothing here")


def _fake_rows(monkeypatch, rows):
    # run_module gets the dotted module below benchmarks (cpu.throughput, peers.trl_sft): its last part is the row
    monkeypatch.setattr(common, "run_module",
                        lambda module, kwargs, timeout, threads=None: dict(rows[module.rpartition(".")[2]]))


def test_main_writes_results_and_prints_json_last(monkeypatch, tmp_path, capsys):
    _fake_rows(monkeypatch, ROWS)
    out = tmp_path / "RESULTS.md"
    assert cli.main(["--json", "--out", str(out), "--check"]) == 0
    stdout = capsys.readouterr().out
    last = json.loads(stdout.strip().splitlines()[-1])
    assert last["throughput_ratio"] == 1.08 and last["all_goals_met"] is True
    assert last["meta"]["rows_run"] == list(cli.ROWS)
    text = out.read_text()
    assert "## 1. Training loop throughput" in text
    assert "| finetune, torch's SDPA kernel choice | 474.8 |" in text  # the ablation arm: 0.986 x 481.5
    assert "With torch's own kernel choice the ratio is 0.986." in text
    assert "## 8. Loss memory" in text and "Full / chunked: **23.1x**" in text
    assert last["loss_memory_ratio"] == 23.1
    assert "## 9. Loading memory" in text and "FSDP2 0.620, FSDP1 0.810 (goal <= 0.6)" in text
    assert "## 10. Memory per phase of a whole run" in text and "**-1.19x** the packed bytes (goal >= 0.4)" in text
    assert last["load_rss_ratio_2_over_1"] == 0.81


def test_main_exit_codes(monkeypatch, tmp_path, capsys):
    _fake_rows(monkeypatch, {**ROWS, "throughput": {**ROWS["throughput"], "throughput_ratio": 0.9}})
    assert cli.main(["--out", str(tmp_path / "a.md")]) == 0  # a missed goal is a result, not a failure
    assert cli.main(["--out", str(tmp_path / "b.md"), "--check"]) == 1
    _fake_rows(monkeypatch, {**ROWS, "startup": {"error": "timed out after 600 s"}})
    assert cli.main(["--out", str(tmp_path / "c.md")]) == 1
    assert "failed rows: startup" in capsys.readouterr().err


def test_a_run_of_some_rows_keeps_the_others_with_their_own_stamps(monkeypatch, tmp_path, capsys):
    """RESULTS.json beside the report carries every row between runs; each row says when it was measured, so
    a row the last command did not run reads as older instead of vanishing or passing for new."""
    out = tmp_path / "RESULTS.md"
    monkeypatch.setattr(common, "commit", lambda: "old111")
    _fake_rows(monkeypatch, ROWS)
    assert cli.main(["--out", str(out)]) == 0
    monkeypatch.setattr(common, "commit", lambda: "new222")
    _fake_rows(monkeypatch, {**ROWS, "packing": {**ROWS["packing"], "packing_speedup": 2.9}})
    assert cli.main(["--out", str(out), "--rows", "packing"]) == 0
    kept = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert kept["packing"]["measured"]["commit"] == "new222" and kept["packing"]["packing_speedup"] == 2.9
    assert kept["throughput"]["measured"]["commit"] == "old111" and list(kept) == list(cli.ROWS)
    md = out.read_text()
    summary = md.split("## Summary")[1].split("\n## ")[0]
    assert "| **2.9** (padding" in summary and "`new222`" in summary.split("| 2 |")[1].split("\n")[0]
    assert "`old111`" in summary.split("| 1 |")[1].split("\n")[0]
    assert "it measured packing." in md and "Measured at `old111`" in md.split("## 1. ")[1].split("## 2. ")[0]
    assert cli.main(["--out", str(out), "--rows", "packing", "--fresh"]) == 0
    assert list(json.loads(out.with_suffix(".json").read_text())["rows"]) == ["packing"]
