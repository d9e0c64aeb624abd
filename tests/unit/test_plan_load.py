"""The load phase the planner plans (plan/loading.py) follows the streaming loader: FSDP ranks hold their
shard while loading, the 70B recipe loads and trains under 24 GiB per GPU, and validate refuses a run
whose load phase does not fit, naming the phase and the shortfall."""
from dataclasses import replace

from finetune import recipe as R
from finetune.plan import estimate as E
from finetune.train import preflight as V
from finetune.util.units import GiB

from ..conftest import ROOT


def test_70b_recipe_plans_every_phase_under_24_gib_per_gpu():
    r = R.load(ROOT / "recipes" / "llama3_70b_qlora.yaml")
    p = E.build(replace(E.from_recipe(r), gpu_memory=24 * GiB))
    assert p.setup.world == 2 and p.setup.strategy == "fsdp"
    assert p.gpu_bytes_per_device < 24 * GiB and 0 < p.load_gpu < 24 * GiB


def test_fsdp_load_is_a_shard_and_the_reader_is_one_per_machine():
    s = E.Setup(model="meta-llama/Meta-Llama-3-70B", seq_len=512, model_dtype="bfloat16", quant_storage="bfloat16")
    one = E.build(replace(s, strategy="fsdp", gpus=2))
    four = E.build(replace(s, strategy="fsdp", gpus=4))
    whole = E.build(s)
    assert four.load_gpu < one.load_gpu < whole.load_gpu
    # 70B in 4-bit is ~33 GiB packed: one process cannot hold it in 24 GiB, four FSDP2 ranks can (two
    # with the shards offloaded to CPU RAM, as the 70B recipe runs).
    assert whole.load_gpu > 33 * GiB and four.load_gpu < 24 * GiB
    assert E.build(replace(s, strategy="fsdp", gpus=2, offload=True)).load_gpu < 8 * GiB
    # CPU RAM while loading: processes, one 2 GiB tensor in flight and the adapters (whole until `prepare`
    # shards them), not a model per process.
    assert one.cpu["loading"] - 2 * E.PROCESS_RAM < 4 * GiB


def test_validate_refuses_a_load_phase_that_does_not_fit():
    r = R.from_dict({"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "data": {"max_seq_len": 128}})
    arch = V.model_problems(r)[1]
    problems = V.memory_problems(r, arch, 1, 24 * GiB, None)
    load = [p for p in problems if p.message.startswith("loading:")]
    assert load and load[0].level == "error" and "short by" in load[0].message
