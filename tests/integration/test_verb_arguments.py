"""Every numeric argument of `generate` is range-checked and generation is bounded by the model's context:
exit 2 with one line naming the argument, never a traceback and never a run that goes on for hours."""
import pytest

from ..conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("args,needle", [
    (["--max-new-tokens", "-5"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", str(10 ** 12)], "more than the model's context"),
    (["--seed", "-1"], "--seed must be 0 to 2^32-1"),
    (["--seed", str(2 ** 64)], "--seed must be 0 to 2^32-1"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--top-p", "nan", "--temperature", "1"], "--top-p must be in (0, 1]"),
], ids=["mnt-neg", "mnt-0", "mnt-1e12", "seed-neg", "seed-2^64", "temp-nan", "temp-inf", "top-p-nan"])
def test_out_of_range_arguments_are_refused(tiny_run, args, needle):
    p = run_cli(["generate", str(tiny_run), "--prompt", "hi", *args], timeout=300)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("prompt,needle", [("", "--prompt #1 is empty"), ("  ", "--prompt #1 is empty"),
                                           ("word " * 5000, "--prompt: the longest prompt has")])
def test_empty_and_overlong_prompts_are_refused(tiny_run, prompt, needle):
    p = run_cli(["generate", str(tiny_run), "--prompt", prompt], timeout=300)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_eval_caps_a_large_held_out_set_and_says_so(tiny_run, tmp_path):
    import json
    import shutil

    import yaml

    rows = tmp_path / "heldout.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i}:", "completion": f" {i}"}) + "\n" for i in range(300)))
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["data"]["eval_sources"] = [{"path": str(rows)}]
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    p = run_cli(["eval", str(run), "--max-rows", "40", "--json"], timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "eval: scoring the first 40 of 300 held-out rows" in p.stdout
    assert json.loads(p.stdout.strip().splitlines()[-1])["eval_rows"] == 40
    p = run_cli(["eval", str(run), "--max-rows", "-1"], timeout=300)
    assert p.returncode == 2 and "--max-rows must be >= 0" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("args,needle", [
    (["estimate", "recipes/tiny_cpu.yaml", "--gpus", str(10 ** 11)], "argument --gpus: must be 1 to 1,000,000"),
    (["estimate", "recipes/tiny_cpu.yaml", "--gpus", "0"], "argument --gpus: must be 1 to 1,000,000"),
    (["estimate", "recipes/tiny_cpu.yaml", "--micro-batch", "-3"], "argument --micro-batch: must be 1 to"),
    (["estimate", "recipes/tiny_cpu.yaml", "--seq-len", "2k"], "argument --seq-len: expected a whole number"),
    (["accelerate-config", "recipes/tiny_cpu.yaml", "--gpus", str(10 ** 13)], "argument --gpus: must be 1 to"),
    (["accelerate-config", "recipes/tiny_cpu.yaml", "--machines", "0"], "argument --machines: must be 1 to"),
    (["slurm", "recipes/tiny_cpu.yaml", "--gpus-per-node", "0"], "argument --gpus-per-node: must be 1 to 1,024"),
], ids=["estimate-gpus-1e11", "estimate-gpus-0", "estimate-mb-neg", "estimate-seq-text", "accel-gpus-1e13",
        "accel-machines-0", "slurm-gpn-0"])
def test_counts_of_the_planning_verbs_are_range_checked(args, needle):
    """A GPU count past any cluster (or below one) is a typo: argparse's own error, exit 2, before any plan."""
    p = run_cli(args, timeout=120)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
