"""A CPU run keeps its activations and working set in RAM: `estimate` plans a CPU recipe (its header says
`planned for: 1 x cpu`) as one, and `validate` refuses a CPU run that does not fit the machine's RAM or the
given --cpu-memory, as it refuses a GPU run that does not fit the GPU."""
import json

from finetune import cli
from finetune.util.units import GiB, TiB

HUGE = ["train.micro_batch_size=100000", "data.max_seq_len=4096"]


def test_estimate_plans_a_cpu_recipe_in_ram(capsys):
    assert cli.main(["estimate", "recipes/tiny_cpu.yaml", *HUGE, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 100,000 sequences of 4096 tokens: terabytes of activations, in RAM on a CPU run (it said 1.50 GiB)
    assert plan["cpu_bytes"]["training"] > 1 * TiB and plan["cpu_peak_phase"] == "training", plan["cpu_bytes"]
    assert cli.main(["estimate", "recipes/tiny_cpu.yaml", "--json"]) == 0  # the shipped recipe: still small
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cpu_bytes_peak"] < 2 * GiB


def test_validate_refuses_a_cpu_run_that_does_not_fit_ram(capsys):
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", *HUGE, "--cpu-memory", "16GiB"]) == 2
    out = capsys.readouterr().out
    assert "error: train.micro_batch_size: planned" in out and "does not fit in 16.00 GiB" in out, out
    assert "micro-batch 100000 x 4096 tokens" in out, out
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", *HUGE]) == 2  # this machine's RAM when not given
    assert "of CPU RAM while training" in capsys.readouterr().out
    assert cli.main(["validate", "recipes/tiny_cpu.yaml", "--cpu-memory", "16GiB"]) == 0  # as shipped: fits
