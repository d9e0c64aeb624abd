"""Fast checks of finetune.train.parallel's recipe -> plugin mapping and finetune.train.optim (one process)."""
from __future__ import annotations

import io

import pytest
import torch

from finetune.recipe import FsdpSpec, TrainSpec
from finetune.train import parallel as D
from finetune.train import optim
from finetune.util.errors import RecipeError


def test_fsdp2_mapping_and_plugin_builds_on_cpu():
    from accelerate.utils import FullyShardedDataParallelPlugin

    kw = D.fsdp_plugin_kwargs(FsdpSpec(sharding_strategy="SHARD_GRAD_OP", transformer_layer_cls=["LlamaDecoderLayer"]),
                              "float32", on_cpu=True)
    assert kw["fsdp_version"] == 2 and kw["reshard_after_forward"] is False
    assert kw["transformer_cls_names_to_wrap"] == ["LlamaDecoderLayer"]
    assert "sync_module_states" not in kw and "use_orig_params" not in kw and "mixed_precision_policy" not in kw
    plugin = FullyShardedDataParallelPlugin(**kw)
    assert plugin.reshard_after_forward is False and plugin.mixed_precision_policy is None
    assert D.fsdp_plugin_kwargs(FsdpSpec(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=True),
                                "float32", True)["reshard_after_forward"] is True


def test_fsdp1_mapping_turns_rank0_loading_off_and_offload_off_on_cpu_only():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    spec = FsdpSpec(version=1, backward_prefetch="BACKWARD_POST", auto_wrap_policy="size", min_num_params=1000,
                    cpu_offload=True)
    cpu = D.fsdp_plugin_kwargs(spec, "float32", on_cpu=True)
    gpu = D.fsdp_plugin_kwargs(spec, "float32", on_cpu=False)
    # Rank-0 loading is off everywhere: the streaming loader is the one reader and sends each rank its shard.
    assert (cpu["sync_module_states"], cpu["cpu_ram_efficient_loading"], cpu["cpu_offload"]) == (False, False, False)
    assert (gpu["sync_module_states"], gpu["cpu_ram_efficient_loading"], gpu["cpu_offload"]) == (False, False, True)
    assert cpu["auto_wrap_policy"] == "size_based_wrap" and cpu["min_num_params"] == 1000
    plugin = FullyShardedDataParallelPlugin(**cpu)  # with sync on, the plugin raises "no available devices"
    assert plugin.reshard_after_forward == ShardingStrategy.FULL_SHARD
    assert plugin.backward_prefetch == BackwardPrefetch.BACKWARD_POST and plugin.use_orig_params is True
    none = D.fsdp_plugin_kwargs(FsdpSpec(version=1, backward_prefetch="NONE"), "float32", True)
    assert FullyShardedDataParallelPlugin(**none).backward_prefetch is None


def test_fsdp_mixed_precision_policy_keeps_fp32_reduce_and_buffers():
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    v2 = D.fsdp_plugin_kwargs(FsdpSpec(mixed_precision_param_dtype="bfloat16"), "bfloat16", True)
    assert v2["mixed_precision_policy"] == MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32)
    v1 = D.fsdp_plugin_kwargs(FsdpSpec(version=1, mixed_precision_param_dtype="float32"), "float32", True)
    assert isinstance(v1["mixed_precision_policy"], MixedPrecision)
    assert v1["mixed_precision_policy"].buffer_dtype == torch.float32


def test_fsdp2_hybrid_sharding_is_a_recipe_error():
    with pytest.raises(RecipeError, match="HYBRID_SHARD"):
        D.fsdp_plugin_kwargs(FsdpSpec(sharding_strategy="HYBRID_SHARD"), "float32", True)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


class _Model(torch.nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])


def _plugin(**kw):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**D.fsdp_plugin_kwargs(FsdpSpec(**kw), "float32", True))


def test_wrap_policy_is_completed_from_the_model():
    plugin = _plugin()
    assert plugin.transformer_cls_names_to_wrap is None
    D.complete_wrap_policy(plugin, _Model())
    assert plugin.transformer_cls_names_to_wrap == ["_Block"]


def test_wrong_layer_class_is_a_recipe_error_with_suggestion():
    with pytest.raises(RecipeError, match="did you mean '_Block'"):
        D.complete_wrap_policy(_plugin(transformer_layer_cls=["_Blok"]), _Model())
    no_names = torch.nn.Sequential(_Block())
    with pytest.raises(RecipeError, match="_no_split_modules"):
        D.complete_wrap_policy(_plugin(), no_names)
    D.complete_wrap_policy(_plugin(auto_wrap_policy="size"), no_names)  # size policy needs no names


def test_autocast_from_spec_and_no():
    from finetune.train.precision import autocast

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(TrainSpec(mixed_precision="bf16"), "cpu"):
        assert (a @ b).dtype == torch.bfloat16
    with autocast(TrainSpec(mixed_precision="no"), "cpu"):
        assert (a @ b).dtype == torch.float32


def _lora_like():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"A": torch.nn.Linear(256, 16, bias=True), "B": torch.nn.Linear(16, 64, bias=False),
                                "frozen": torch.nn.Linear(8, 8)}).requires_grad_(True)


def test_param_groups_decay_only_matrices_and_skip_frozen():
    m = _lora_like()
    m["frozen"].requires_grad_(False)
    for arg in (m, m.parameters(), m.named_parameters()):
        decay, rest = optim.param_groups(arg, 0.1)
        assert [p.shape for p in decay["params"]] == [(16, 256), (64, 16)] and decay["weight_decay"] == 0.1
        assert [p.shape for p in rest["params"]] == [(16,)] and rest["weight_decay"] == 0.0
    with pytest.raises(ValueError):
        optim.param_groups(m["frozen"], 0.1)


def test_paged_on_cpu_falls_back_with_one_notice(capsys):
    optim._notices.clear()
    for _ in range(2):
        opt = optim.build_optimizer(_lora_like(), TrainSpec(optimizer="paged_adamw_8bit"))
    assert isinstance(opt, optim.sharded_adamw8bit_cls()) and opt.is_paged is False
    assert capsys.readouterr().out.count("paged_adamw_8bit") == 1
    assert isinstance(optim.build_optimizer(_lora_like(), TrainSpec(optimizer="adamw_torch")), torch.optim.AdamW)


def _train(opt_cls, steps, model=None, **kw):
    model = model or _lora_like()
    opt = opt_cls(optim.param_groups(model, 0.01), lr=1e-2, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return model, opt


def test_sharded_adamw8bit_matches_bitsandbytes_on_plain_tensors():
    import bitsandbytes as bnb

    ours, opt = _train(optim.sharded_adamw8bit_cls(), 3)
    ref, _ = _train(bnb.optim.AdamW8bit, 3)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    dtypes = {tuple(p.shape): opt.state[p]["state1"].dtype for p in ours.parameters()}
    assert dtypes[(16, 256)] == torch.uint8 and dtypes[(16,)] == torch.float32  # bnb's 4096-element rule


def test_state_dict_round_trip_resumes_exactly():
    cls = optim.sharded_adamw8bit_cls()
    straight, _ = _train(cls, 4)
    model, opt = _train(cls, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # what checkpoint.py writes per rank
    buf.seek(0)
    fresh = cls(optim.param_groups(model, 0.01), lr=1e-2)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # replay the generator past the first two steps' gradients
        for p in model.parameters():
            torch.randn(p.shape, generator=g)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        fresh.step()
    for p, q in zip(model.parameters(), straight.parameters()):
        assert torch.equal(p, q)


def test_scheduler_warmup_then_cosine_to_zero():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = optim.build_scheduler(opt, TrainSpec(warmup_steps=2, lr_scheduler="cosine"), total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:3] == [0.0, 0.5, 1.0] and lrs[3] < 1.0 and sched.get_last_lr()[0] == pytest.approx(0.0)
    const = optim.build_scheduler(torch.optim.SGD([p], lr=1.0), TrainSpec(lr_scheduler="constant"), 10)
    assert const.get_last_lr() == [1.0]


@pytest.fixture
def fresh_accelerate_state():
    import os

    from accelerate.state import AcceleratorState

    env = dict(os.environ)  # Accelerate writes ACCELERATE_USE_FSDP / FSDP_* into the environment
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(env)


def test_make_accelerator_one_process(fresh_accelerate_state, capsys, monkeypatch):
    from finetune.recipe import DistributedSpec

    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(var, raising=False)
    train = TrainSpec(gradient_accumulation_steps=4, mixed_precision="bf16")
    acc = D.make_accelerator(DistributedSpec(), FsdpSpec(), train, "float32")
    # No parameter casting by Accelerate, no loss rescaling in backward: the loop owns both.
    assert acc.mixed_precision == "no" and acc.gradient_accumulation_steps == 1
    from finetune.train.precision import autocast

    with autocast(train, acc.device.type):  # the loop's forward: the recipe's precision on the accelerator's device
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16
    with pytest.raises(RecipeError, match="launcher started 1"):
        D.make_accelerator(DistributedSpec(strategy="ddp", num_processes=2), FsdpSpec(), train, "float32")
    acc = D.make_accelerator(DistributedSpec(strategy="fsdp"), FsdpSpec(), train, "float32")
    assert acc.distributed_type == "NO" and "nothing to shard" in capsys.readouterr().out


def test_launcher_fsdp_config_with_other_strategy_is_a_recipe_error(fresh_accelerate_state, monkeypatch):
    from finetune.recipe import DistributedSpec

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeError, match="launcher config uses FSDP"):
        D.make_accelerator(DistributedSpec(strategy="ddp"), FsdpSpec(), TrainSpec(), "float32")


def test_fsdp_on_cpu_refuses_an_accelerate_it_was_not_written_for():
    """The CPU-FSDP state rewrite is the one private use of Accelerate's state: outside the tested releases it
    stops with a message instead of training unsharded."""
    from types import SimpleNamespace

    acc = SimpleNamespace(state=SimpleNamespace(distributed_type=None, fsdp_plugin=None, device=None))
    with pytest.raises(RuntimeError, match="accelerate 1.10 to before 2.0; this is 2.1.0"):
        D.fsdp_on_cpu(acc, SimpleNamespace(fsdp_version=2), version="2.1.0")
    D.fsdp_on_cpu(acc, SimpleNamespace(fsdp_version=1), version="1.15.0")
    assert acc.state.fsdp_plugin.fsdp_version == 1 and acc.state.device == torch.device("cpu")
