"""finetune.train.keepers.memory: `peak_sites` (the replay of torch's allocator trace that names what is alive
at a peak; the trace itself is recorded only on CUDA, in torch's TraceEntry format) and the end-of-run table
with the planner's figures beside the measured phases."""
import re

import pytest

from finetune.train.keepers.memory import peak_sites


def frame(file, line, name):
    return {"filename": file, "line": line, "name": name}


def test_the_sites_alive_at_the_peak_are_summed_and_ranked():
    head = [frame("/x/torch/nn/functional.py", 1, "linear"), frame("/w/finetune/train/loss.py", 170, "forward")]
    gather = [frame("/x/torch/_ops.py", 9, "__call__"),
              frame("/v/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 40, "all_gather")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": gather},
        {"action": "alloc", "addr": 2, "size": 50, "frames": head},
        {"action": "alloc", "addr": 3, "size": 30, "frames": head},
        {"action": "free_requested", "addr": 2, "size": 50},  # not yet free: still counted
        {"action": "alloc", "addr": 4, "size": 10, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 5, "size": 120, "frames": head},  # 160 live: below the 190 peak
    ]
    out = peak_sites(trace)
    assert out["peak_bytes_traced"] == 190
    sites = {s["site"]: s["bytes"] for s in out["sites"]}
    assert sites == {"torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:40 all_gather [__call__]": 100,
                     "finetune/train/loss.py:170 forward [linear]": 80, "(no library frame) [?]": 10}
    assert [s["bytes"] for s in out["sites"]] == [100, 80, 10]


def test_the_end_of_run_table_puts_the_plan_beside_the_phases_it_plans():
    from finetune import recipe as recipe_mod
    from finetune.train.keepers.memory import planned, table

    rec = recipe_mod.load("recipes/llama3_8b_qlora.yaml")
    gpu = planned(rec, world=1, cuda=True)
    assert 4 * 2**30 < gpu["load"] < gpu["steps"] < gpu["steps_reserved"] < 10 * 2**30
    cpu = planned(rec, world=1, cuda=False)
    assert set(cpu) == {"load", "steps", "save"} and all(v > 0 for v in cpu.values())
    gib = 2**30
    memory = {"kind": "cuda", "plan": gpu, "ranks": [
        {"phases": {"load": {"peak_allocated": 5 * gib, "peak_reserved": 5 * gib},
                    "steps": {"peak_allocated": 7 * gib, "peak_reserved": 8 * gib},
                    "save": {"peak_allocated": 5 * gib, "peak_reserved": 8 * gib}}}]}
    figures = {line.split()[0]: [float(x) for x in re.findall(r"([\d.]+) GiB", line)]
               for line in table(memory).splitlines()[1:]}
    # measured allocated and reserved, then the plan beside the phase it plans, in GiB
    assert figures["steps"] == pytest.approx([7, 8, gpu["steps"] / gib], abs=0.005)
    assert figures["load"] == pytest.approx([5, 5, gpu["load"] / gib], abs=0.005)
    assert figures["save"] == pytest.approx([5, 8])  # no GPU plan for the save phase


def test_a_model_the_planner_does_not_know_has_no_plan_and_the_builtin_has_one():
    from finetune import recipe as recipe_mod
    from finetune.train.keepers.memory import planned

    unknown = recipe_mod.from_dict({"model": {"name": "acme/unknown-model-7b"}})
    assert planned(unknown, world=1, cuda=False) is None  # no shapes: the table shows the measured figures alone
    tiny = recipe_mod.from_dict({"model": {"name": "builtin:tiny-llama"}})
    assert planned(tiny, world=1, cuda=False) is not None  # planned from its config
