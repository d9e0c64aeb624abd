"""benchmarks/RESULTS_GPU.md (benchmarks/gpu/results_page.py): generated from the kept proof runs, it opens with
the newest 8B step per card and every stage's newest figure, and holds no Python literals or scratch paths."""
import json
import re

from benchmarks.gpu import report, results_page


def test_the_committed_page_is_what_the_kept_runs_generate():
    assert results_page.PAGE.read_text() == results_page.page(), \
        "benchmarks/RESULTS_GPU.md is stale: run `python -m benchmarks.gpu.results_page` and commit it"


def test_the_first_screen_answers_what_an_8b_step_costs_on_an_h100():
    first = "\n".join(results_page.PAGE.read_text().splitlines()[:12])
    h100 = next(line for line in first.splitlines() if line.startswith("- **H100"))
    for figure in ("**5,805 tokens/s**", "**0.706 s per step**", "**7.54 GiB allocated** (plan 7.35)", "`26988d7"):
        assert figure in h100, figure
    assert "`python -m benchmarks.gpu_proof --out-dir OUT --stages env,single --deadline 420`" in first


def test_no_python_literals_scratch_paths_or_repeated_headings():
    text = results_page.PAGE.read_text()
    assert not re.search(r"\{'|': ", text) and "/tmp/" not in text and "/root/" not in text
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings)), [h for h in headings if headings.count(h) > 1]


def _run(tmp_path, name, stages):
    (tmp_path / name).write_text(json.dumps({"stages": stages, "plan_note": None}))


def test_the_newest_run_of_a_stage_is_current_and_a_superseded_one_never_is(tmp_path):
    mem = {"kind": "cuda", "phases": {"steps": {"peak_allocated_gib": 2.0, "peak_reserved_gib": 2.5}}}
    run = {"trained_tokens_per_s": 1000.0, "s_per_step": 0.5, "timed_steps": 4, "first_loss": 1, "last_loss": 1,
           "losses_finite": True,
           "memory": mem, "plan": {"allocated_gib": 1.9, "reserved_gib": 2.4, "loading_gib": 1.0},
           "errors_pct": {"steps_allocated": 5.3, "steps_reserved": 4.2}}
    old = {"status": "ok", "what": "w", "device": "NVIDIA A100", "date": "2026-01-01 10:00 UTC", "commit": "aaa",
           "result": {**run, "trained_tokens_per_s": 900.0}}
    _run(tmp_path, "a.json", {"moe": old})
    _run(tmp_path, "b.json", {"moe": {**old, "device": "NVIDIA H100", "date": "2026-02-01 10:00 UTC",
                                      "commit": "bbb", "result": run},
                              "moe_first_run": {**old, "date": "2026-03-01 10:00 UTC", "commit": "ccc"}})
    runs = results_page.load_runs(("a.json", "b.json"), tmp_path)
    row = next(r for r in results_page.current_rows(runs) if r.startswith("| moe |"))
    assert "| H100 | `bbb` | 2026-02-01 10:00 UTC | 1,000 tokens/s, 0.5 s/step; steps 2.00 / 2.50 GiB |" in row
    assert "| 1.90 / 2.40 GiB | +5.3% / +4.2% |" in row and "--stages moe" in row
    detail = "\n".join(results_page.detail(runs))
    assert detail.splitlines().count("### moe") == 1 and "*moe*" in detail and "`ccc` (an earlier run: w)" in detail and "`aaa`" in detail
    assert results_page.current_rows(runs)[2].startswith("| env | - |")  # never run: said so, with its command


def test_result_dicts_read_as_words():
    assert report.kv({"steps_allocated": 2.6, "load_reserved_vs_loading_plan": -9.2}) == \
        "steps allocated +2.6%, load reserved vs loading plan -9.2%"
    assert report.kv({"ok": True, "run": "/tmp/work/x", "eval": {"loss": 12.58765, "rows": [1, 2]}}) == \
        "ok True, eval (loss 12.59, rows [1, 2])"
