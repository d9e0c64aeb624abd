"""Row 7 (benchmarks/peers/trl_sft.py) without training: the identical-tokens checks on real collators, the step
window, the loss verdict, the recipe mapping and the report. (No timing here: the row itself measures.)"""
import copy

from benchmarks.common import TINY_RECIPE
from benchmarks.cpu import report
from benchmarks.peers import trl_compare, trl_sft
from benchmarks.peers.trl_arms import rate_between
from finetune import recipe as recipe_mod

ROWS = [{"input_ids": [1, 5, 6, 7, 2], "labels": [-100, -100, 6, 7, 2]},
        {"input_ids": [1, 8, 9], "labels": [-100, 9, -100]},
        {"input_ids": [1, 4, 4, 4, 4, 4, 2], "labels": [-100, -100, -100, -100, 4, 4, 2]}]


def test_digest_is_of_tokens_and_labels_in_order():
    same = [{"input_ids": tuple(r["input_ids"]), "labels": list(r["labels"]), "where": "x"} for r in ROWS]
    assert trl_compare.digest(same) == trl_compare.digest(ROWS)
    changed = copy.deepcopy(ROWS)
    changed[1]["labels"][2] = 3
    assert trl_compare.digest(changed) != trl_compare.digest(ROWS)
    assert trl_compare.digest(ROWS[::-1]) != trl_compare.digest(ROWS)


def test_compare_rows_counts_and_locates_differences():
    assert trl_compare.compare_rows(ROWS, copy.deepcopy(ROWS))["identical"]
    changed = copy.deepcopy(ROWS)
    changed[2]["input_ids"][3] = 0
    got = trl_compare.compare_rows(ROWS, changed)
    assert got["mismatched"] == 1 and got["first_mismatch"] == 2 and not got["identical"]
    assert trl_compare.compare_rows(ROWS, ROWS[:2])["mismatched"] == 1


def test_finetune_and_trl_collators_agree_on_the_same_rows():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from finetune.data.batching import collate

    ours = {k: v.tolist() for k, v in collate(ROWS, 0).items()}
    theirs = {k: v.tolist() for k, v in DataCollatorForLanguageModeling(pad_token_id=0)(copy.deepcopy(ROWS)).items()}
    assert trl_compare.compare_batches(ours, theirs) == {"identical": True, "diffs": []}
    theirs["labels"][1][1] = -100  # one trained token fewer on one side: the check must see it
    assert trl_compare.compare_batches(ours, theirs)["diffs"] == ["labels"]
    theirs = {k: v.tolist() for k, v in DataCollatorForLanguageModeling(pad_token_id=0)(ROWS[:2]).items()}
    assert trl_compare.compare_batches(ours, theirs)["identical"] is False


def test_rate_counts_the_steps_after_the_window():
    marks = [(1, 10.0, 50), (2, 11.0, 60), (3, 12.0, 40), (4, 14.0, 100)]
    r = rate_between(marks, after_step=2)
    assert r["tokens"] == 140 and r["seconds"] == 3.0 and r["steps"] == 2 and r["tokens_per_s"] == 140 / 3


def test_loss_not_worse_allows_seed_spread_only():
    assert trl_compare.loss_not_worse([0.52, 0.55, 0.50], [0.51, 0.53, 0.56])
    assert trl_compare.loss_not_worse([0.55, 0.59, 0.57], [0.50, 0.53, 0.55])  # 0.57 <= 0.527 + 0.05 spread
    assert not trl_compare.loss_not_worse([0.70, 0.71, 0.72], [0.50, 0.51, 0.52])


def test_recipe_numbers_map_to_trainer_names_and_overrides_validate():
    for steps in (4, 200):
        rec = recipe_mod.load(TINY_RECIPE, trl_sft.overrides(seed=3, steps=steps, window=2))
        assert (rec.train.max_steps, rec.train.seed, rec.data.shuffle_seed) == (steps, 3, 3)
    n = trl_sft.recipe_numbers(recipe_mod.load(TINY_RECIPE, []))
    assert n["optimizer"] == "paged_adamw_8bit" and n["lr_scheduler"] == "cosine"
    assert (n["lora_r"], n["micro_batch_size"], n["warmup_steps"]) == (16, 16, 20)


def test_without_trl_the_row_says_so(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    r = trl_sft.run()
    assert r["available"] is False and "trl is not installed" in r["reason"]
    assert report.status(r) == "not available"


def _sample(seed, tps, rss, loss):
    return {"seed": seed, "tokens_per_s": tps, "peak_rss": rss, "eval_loss": loss, "exact_match": 0.5,
            "own_eval_loss": loss}


def result():
    samples = {"finetune": [_sample(s, 60.0 + s, 550e6, 0.5 + s / 100) for s in (1, 2, 3)],
               "trl": [_sample(s, 50.0 + s, 560e6, 0.51 + s / 100) for s in (1, 2, 3)],
               "trl_fp32_adapters": [_sample(s, 48.0 + s, 561e6, 0.505) for s in (1, 2, 3)]}
    checks = {"digests_equal": True, "rows": 4000, "batches_checked": 60, "batches_identical": True}
    numbers = trl_sft.recipe_numbers(recipe_mod.load(TINY_RECIPE, []))
    return trl_sft.summarise(samples, checks, [1, 2, 3], 200, 20, numbers)


def test_summary_ratios_and_section_list_every_sample():
    r = result()
    assert r["tokens_per_s_ratio"] == 62.0 / 52.0 and r["peak_rss_ratio"] == 550 / 560 and r["loss_not_worse"]
    text = "\n".join(trl_compare.section(r))
    for arm in ("| finetune | 1 | 61 |", "| TRL SFTTrainer | 3 | 53 |", "fp32 adapters (ablation) | 2 | 50 |"):
        assert arm in text
    assert "**1.19x**" in text and "Adapter precision" in text and "(4000 rows)" in text
    results = {"meta": {}, "rows": {"trl_sft": r}}
    assert "| 7 | finetune / TRL SFTTrainer" in report.summary_table(results)
    assert "**1.19x**, **0.982x**, **yes**" in report.summary_table(results)
    assert report.summary({**results, "meta": {}})["trl_tokens_per_s_ratio"] == r["tokens_per_s_ratio"]

