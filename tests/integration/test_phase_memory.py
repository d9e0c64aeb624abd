"""Memory per phase, over whole runs launched as users launch them (benchmarks/cpu/phase_rss.py: one
process with recipes/tiny_cpu.yaml, and 2 processes of recipes/tiny_cpu_fsdp.yaml under `accelerate launch`
with FSDP2 and with FSDP1; 2 steps at micro-batch 2 and the end-of-run eval). Every run writes
RUN_DIR/memory.json: each rank's peak RSS per phase, and the planner's CPU figures for the same phases.
RSS is per process, so the three runs go side by side (under FSDP one rank quantizes while the other waits:
the one process's load takes that core), each process on one thread (as accelerate gives each of 2 FSDP
ranks on 2 cores), and the eval reads one batch (its peak is one batch's). On the 2 GB model (16 layers) that
gives the same figures as one run after another with 2 eval batches (within 0.02 GiB per phase, savings
0.56-0.61x); the test measures the same model at 10 layers (conftest.PHASE_BIG_LAYERS says why).

- The plan's CPU RAM per process (load, steps, save) is within 20% of the largest rank's measured peak, for
  the builtin tiny model and for a 1.7 GB synthetic bf16 Llama (10 layers, hidden 2048, vocab 128256), one
  process and 2 FSDP2 processes (FSDP1 within 25%: its save keeps more than the plan says).
- On the 1.7 GB model, each FSDP rank's whole-run growth is below the one process's by at least 0.4x the
  model's packed 4-bit bytes (each rank holds half of them), in every phase, not only the load.
"""
import pytest

from benchmarks.cpu import phase_rss

from .conftest import PHASE_SETTINGS

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def tiny():
    return phase_rss.run(model="builtin:tiny-llama", **PHASE_SETTINGS)


@pytest.fixture(scope="module")
def big(phase_memory_big):  # built first by one worker (conftest._longest_first): it was the suite's tail
    return phase_memory_big


@pytest.mark.parametrize("which", ["tiny", "big"])
def test_the_planned_cpu_ram_of_each_phase_is_within_20_percent(request, which):
    res = request.getfixturevalue(which)
    errors = res["plan_error"]
    assert len(errors) == 9, errors  # load, steps and save of the single, FSDP2 and FSDP1 runs
    assert all(abs(e) <= 0.20 for k, e in errors.items() if not k.startswith("fsdp1")), errors
    # FSDP1's save keeps ~0.2 GiB more than FSDP2's (measured -18% at 16 layers, -14% at 10; not yet planned)
    assert all(abs(e) <= 0.25 for k, e in errors.items() if k.startswith("fsdp1")), errors


def test_each_fsdp_rank_holds_less_than_one_process_over_the_whole_run(big):
    whole = big["whole_run_growth_gib"]
    for version in ("fsdp2", "fsdp1"):
        assert big[f"{version}_saving_over_packed"] >= 0.4, (version, whole, big["packed_4bit_gib"])
        # in every phase the largest rank is below the one process (the load and the fill aside: one
        # process's load is a rank's load plus its fill, which has no counterpart there)
        for phase in ("steps", "eval", "save", "export"):
            assert max(big[version]["growth_gib"][phase]) < max(big["single"]["growth_gib"][phase]), (version, phase)
