"""Accelerate objects from the recipe: one process, DDP or FSDP (1 or 2), on GPUs or, as a feature, on CPU.

The fp32-preserving setup (DESIGN.md) is the default: Accelerate runs with mixed_precision="no", so FSDP
never casts parameters (the packed 4-bit storage must never be cast), master weights and buffers stay in
their stored dtype, and the loop gets bf16 compute from `precision.autocast(...)` around the forward.

FSDP on CPU: Accelerate only turns FSDP on for GPU-like distributed types. Without a device it builds a
gloo process group (MULTI_CPU) and would train each process alone, unsharded, without a word. We build
`Accelerator(cpu=True)` and then switch its state to FSDP with our plugin, so `prepare` runs exactly the
code a GPU run runs (fully_shard / FullyShardedDataParallel). `prepare` checks that sharding happened.
"""
from __future__ import annotations

import difflib
import os
import warnings

import torch

from finetune.recipe import DistributedSpec, FsdpSpec, TrainSpec
from finetune.train.machine import cuda_unusable_reason
from finetune.util.dtypes import torch_dtype
from finetune.util.errors import RecipeError, RunError
from finetune.util.log import log
from finetune.weights.shard.fsdp import before_wrap

# FSDP2 expresses FSDP1's two plain strategies as a bool; the hybrid/replicated ones need a 2-D mesh.
_FSDP2_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


def has_accelerator_device() -> bool:
    """A CUDA, ROCm, XPU or other torch accelerator is usable here (torch.accelerator, torch >= 2.6)."""
    return bool(torch.accelerator.is_available())


def resolve_strategy(dist: DistributedSpec, fsdp_version: int, world: int | None = None) -> DistributedSpec:
    """`strategy: auto` made concrete for the processes started (one process: single; several: fsdp), said
    in one line. Recipes loaded from a file arrive resolved (finetune.recipe.read); this also covers
    specs built in code."""
    if dist.strategy == "auto":
        world = world or dist.num_processes or int(os.environ.get("WORLD_SIZE", "1") or 1)
        dist = dist.model_copy(update={"strategy": "fsdp" if world > 1 else "single"})
        dist._from_auto = True
    if dist.from_auto:
        world = world or int(os.environ.get("WORLD_SIZE", "1") or 1)
        how = f"fsdp (FSDP{fsdp_version})" if dist.strategy == "fsdp" else dist.strategy
        log.info(f"distributed.strategy: auto -> {how} for {world} process{'es' if world > 1 else ''}")
    return dist


# ---------------------------------------------------------------------------------------------------
# Recipe -> FullyShardedDataParallelPlugin


def fsdp_plugin_kwargs(fsdp: FsdpSpec, model_dtype: str, on_cpu: bool) -> dict:
    """Pure mapping of the `fsdp` section to FullyShardedDataParallelPlugin keyword arguments.

    Every field is set explicitly, so FSDP_* variables left by `accelerate launch` never override the
    recipe. Settings a version does not have are passed as None (the plugin warns or raises otherwise).
    """
    v1 = fsdp.version == 1
    # state_dict_type: only Accelerate's save_state reads it, which no checkpoint here uses (the adapter is
    # gathered, each rank saves its optimizer state); fixed so a launcher's variable cannot change it.
    kw: dict = {"fsdp_version": fsdp.version, "state_dict_type": "SHARDED_STATE_DICT",
                "activation_checkpointing": False}  # checkpointing is model.gradient_checkpointing's job
    # Accelerate's rank-0 loading (and FSDP1's broadcast at wrap time) would broadcast rank 0's placeholders:
    # the streaming loader already is the one-reader path, and every rank receives its shard from it.
    kw["cpu_ram_efficient_loading"] = False
    if v1:
        # Accelerate takes FSDP1's strategy as `reshard_after_forward` too; `sharding_strategy` is deprecated.
        kw["reshard_after_forward"] = fsdp.sharding_strategy
    else:
        if fsdp.reshard_after_forward is not None:
            kw["reshard_after_forward"] = fsdp.reshard_after_forward
        elif fsdp.sharding_strategy in _FSDP2_RESHARD:
            kw["reshard_after_forward"] = _FSDP2_RESHARD[fsdp.sharding_strategy]
        else:
            raise RecipeError([f"fsdp.sharding_strategy: {fsdp.sharding_strategy} needs a 2-D device mesh, which "
                               "FSDP2 here does not build. Fix: use fsdp.version: 1, or FULL_SHARD/SHARD_GRAD_OP"])
    if fsdp.auto_wrap_policy == "transformer":
        kw["auto_wrap_policy"] = "transformer_based_wrap"
        # None is completed from the model (`_no_split_modules`) by `prepare`, once the model exists.
        kw["transformer_cls_names_to_wrap"] = list(fsdp.transformer_layer_cls) if fsdp.transformer_layer_cls else None
    else:
        kw["auto_wrap_policy"] = "size_based_wrap"
        kw["min_num_params"] = fsdp.min_num_params
    # CPU-only (physical): offload copies parameters between host and accelerator memory; on CPU they
    # already live in host RAM, and torch 2.13 raises "Cannot access accelerator device when none is
    # available" for FSDP1 and FSDP2 offload alike (measured). docs/gpu_paths.md.
    kw["cpu_offload"] = fsdp.cpu_offload and not on_cpu
    if v1:
        kw["sync_module_states"] = False
        kw["backward_prefetch"] = "NO_PREFETCH" if fsdp.backward_prefetch == "NONE" else fsdp.backward_prefetch
        kw["forward_prefetch"] = fsdp.forward_prefetch
        kw["use_orig_params"] = fsdp.use_orig_params
    if fsdp.mixed_precision_param_dtype is not None:
        kw["mixed_precision_policy"] = _fsdp_mixed_precision(fsdp.version, torch_dtype(fsdp.mixed_precision_param_dtype))
    return kw


def _fsdp_mixed_precision(version: int, param_dtype: torch.dtype):
    # Gradients are reduced and buffers (RoPE inv_freq) kept in fp32 whatever the parameter dtype.
    if version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    from torch.distributed.fsdp import MixedPrecision
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# Accelerator


def make_accelerator(dist: DistributedSpec, fsdp: FsdpSpec, train: TrainSpec, model_dtype: str, **trackers):
    """An Accelerator for `dist.strategy`; FSDP on CPU goes through the real FSDP path (see module doc).

    The returned accelerator has mixed_precision="no"; the forward's autocast comes from
    `train.mixed_precision` (train/precision.autocast). Its gradient_accumulation_steps stays 1: the loop owns
    accumulation and normalises the loss by the step's tokens itself, and Accelerate would divide every
    `accelerator.backward` by the accumulation steps once more. `trackers`: log_with and project_config
    (train.keepers.trackers.accelerator_kwargs).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    on_cpu = not has_accelerator_device()
    if on_cpu and (reason := cuda_unusable_reason()):
        raise RunError([f"device: {reason}"])  # never train on the CPU in place of a broken GPU
    if dist.backend == "nccl" and on_cpu:
        raise RecipeError(["distributed.backend: nccl needs CUDA GPUs and none is available. Fix: use auto or gloo"])
    if dist.backend == "gloo" and not on_cpu:
        # gloo moves every all-gather and reduce-scatter through host memory: many times slower than NCCL,
        # and FSDP's collectives on CUDA tensors are not all implemented for it.
        raise RecipeError(["distributed.backend: gloo on GPUs (CUDA tensors) would route every collective through "
                           "the CPU. Fix: use distributed.backend: auto (nccl on GPUs, gloo on CPU)"])
    dist = resolve_strategy(dist, fsdp.version)
    launcher_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if launcher_fsdp and dist.strategy != "fsdp":
        raise RecipeError([f"distributed.strategy: {dist.strategy}, but the launcher config uses FSDP. Fix: launch "
                           "with the config from `finetune accelerate-config RECIPE`, or set distributed.strategy: fsdp"])
    plugin = None
    if dist.strategy == "fsdp":
        plugin = FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(fsdp, model_dtype, on_cpu))
    import datetime

    # A hung rank must not hold the others forever: collectives give up after distributed.timeout_minutes.
    pg = {"timeout": datetime.timedelta(minutes=dist.timeout_minutes)}
    handlers = [InitProcessGroupKwargs(**pg)]
    # The plugin is passed on CPU too, although Accelerate leaves it unused there: otherwise, under
    # `accelerate launch` with an FSDP config, Accelerate builds its own plugin from the launcher's FSDP_*
    # variables, and FSDP1's sync_module_states=true raises "no available devices" on CPU.
    with warnings.catch_warnings():
        # Accelerate picks the thread count of a multi-process CPU run when OMP_NUM_THREADS is unset and
        # warns that it did; the choice is sound (cores per process) and set explicitly, it is taken as is.
        warnings.filterwarnings("ignore", message="OMP_NUM_THREADS/MKL_NUM_THREADS unset")
        acc = Accelerator(cpu=on_cpu, mixed_precision="no", fsdp_plugin=plugin,
                          kwargs_handlers=handlers, **trackers)
    if dist.num_processes is not None and dist.num_processes != acc.num_processes:
        raise RecipeError([f"distributed.num_processes is {dist.num_processes} but the launcher started "
                           f"{acc.num_processes}. Fix: launch {dist.num_processes} processes or change the recipe"])
    if plugin is not None and on_cpu and acc.distributed_type == DistributedType.MULTI_CPU:
        fsdp_on_cpu(acc, plugin)
    if plugin is not None and acc.distributed_type != DistributedType.FSDP:
        log.info(f"fsdp: {acc.num_processes} process without a launcher; nothing to shard, training unsharded "
                 "(start several with `accelerate launch` or torchrun)")
    if fsdp.cpu_offload and on_cpu and dist.strategy == "fsdp":
        log.info("fsdp: cpu_offload has no effect on CPU (parameters already live in CPU RAM)")
    return acc


# The Accelerate releases whose state `fsdp_on_cpu` was written against and tested with (tests run FSDP on CPU
# through it); outside them it refuses with a message instead of training unsharded or crashing in prepare.
ACCELERATE_CPU_FSDP = ((1, 10), (2, 0))


def fsdp_on_cpu(acc, plugin, version: str | None = None) -> None:
    """Accelerate's FSDP on CPU (the gloo test harness, CPU-only machines): Accelerate builds a MULTI_CPU state
    and would train every process alone, unsharded. Switch its (shared, private) state to FSDP with our
    plugin before prepare; FSDP1 also needs the plain "cpu" device ("cpu:0" fails FSDP1's device_id check).
    GPUs never come here. The only place that writes Accelerate's state, guarded by version and attributes."""
    import accelerate
    from accelerate.utils import DistributedType

    version = version or accelerate.__version__
    got = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    lo, hi = ACCELERATE_CPU_FSDP
    state = acc.state
    if not lo <= got < hi or not all(hasattr(state, a) for a in ("distributed_type", "device")):
        raise RuntimeError(f"FSDP on CPU switches Accelerate's state to FSDP, written for accelerate "
                           f"{lo[0]}.{lo[1]} to before {hi[0]}.{hi[1]}; this is {version}. Train on GPUs, or "
                           "install a tested accelerate (constraints.txt)")
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if plugin.fsdp_version == 1:
        state.device = torch.device("cpu")



# ---------------------------------------------------------------------------------------------------
# prepare


def _layer_class_names(model) -> list[str]:
    # A PeftModel forwards attribute lookups down to the transformers model, which names its blocks here.
    return list(getattr(model, "_no_split_modules", None) or [])


def complete_wrap_policy(plugin, model) -> None:
    """Fill the plugin's layer classes from the loaded model; bad names become a RecipeError."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if policy is not transformer_auto_wrap_policy:
        return
    if not plugin.transformer_cls_names_to_wrap:
        names = _layer_class_names(model)
        if not names:
            raise RecipeError([f"fsdp.transformer_layer_cls: {type(model).__name__} does not name its layer "
                               "classes (_no_split_modules). Fix: list them, e.g. [LlamaDecoderLayer], or use "
                               "fsdp.auto_wrap_policy: size"])
        plugin.transformer_cls_names_to_wrap = names
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in plugin.transformer_cls_names_to_wrap if n not in present]
    if missing:
        hints = [f"'{n}' is not a module class of this model"
                 + "".join(f" (did you mean '{c}'?)" for c in difflib.get_close_matches(n, present, n=1))
                 for n in missing]
        raise RecipeError([f"fsdp.transformer_layer_cls: {h}" for h in hints])


def describe_fsdp(accelerator) -> str:
    plugin = accelerator.state.fsdp_plugin
    backend = accelerator.state.backend or "?"
    head = f"fsdp: FSDP{plugin.fsdp_version} over {backend}, {accelerator.num_processes} processes"
    if plugin.fsdp_version == 2:
        shard = f"reshard_after_forward={plugin.reshard_after_forward}"
    else:
        strategy = plugin.sharding_strategy or plugin.reshard_after_forward
        shard = f"sharding_strategy={strategy.name}, use_orig_params={plugin.use_orig_params}"
    if plugin.transformer_cls_names_to_wrap:
        wrap = "wrapping " + ", ".join(plugin.transformer_cls_names_to_wrap)
    else:
        wrap = f"wrapping modules above {plugin.min_num_params} parameters"
    return f"{head}, {shard}, {wrap}"


def is_sharded(model) -> bool:
    """True when `model` was really wrapped by FSDP (FSDP2 FSDPModule or FSDP1 FullyShardedDataParallel)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def wrap(accelerator, model, optimizer, plan=None):
    """(model, optimizer) = accelerator.prepare(model, optimizer) plus what FSDP needs around it. With the
    loader's plan (FSDP placements) the base is wrapped as meta tensors, which `weights.shard.fsdp.fill_shards`
    fills next with the same plan.

    Before: the wrap policy is completed from the loaded model, and the one call into the loader,
    `weights.shard.fsdp.before_wrap`, readies the base (bitsandbytes' in-place CPU repacking off; under FSDP
    the meta tensors to shard, FSDP1's param_init_fn, the frozen tables left whole). After: the model must really be sharded
    (a silent unsharded run proves nothing), and rank 0 logs one line saying how.
    FSDP2 swaps parameters for DTensors; the optimizer is handed the new ones by Accelerate, which is why
    model and optimizer are wrapped together. Keep the LR scheduler out of accelerator.prepare:
    its AcceleratedScheduler steps once per process on every call (it assumes steps were counted for
    one process), so with 2 processes warmup and decay would run twice as fast.
    """
    from accelerate.utils import DistributedType

    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    if plugin is not None:
        complete_wrap_policy(plugin, model)
    before_wrap(model, plan, plugin, accelerator.device)  # the meta tensors FSDP shards; what each version needs
    with warnings.catch_warnings():
        # FSDP1 at world size 1 warns that it runs NO_SHARD; the recipe check has said so in its own words
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
        out = accelerator.prepare(model, optimizer)
    if plugin is not None:
        if not is_sharded(out[0]):
            raise RuntimeError(f"FSDP was configured but prepare returned an unsharded {type(out[0]).__name__}")
        log.info(describe_fsdp(accelerator))
    return out


def leave_process_group() -> None:
    """The end of a finished run: the process group goes before the interpreter does (NCCL warns at exit
    about a group left alive). Not after a failure, where a rank still inside a collective would hang it."""
    from torch import distributed

    if distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()



def host_group(accelerator):
    """A gloo process group over all ranks for the host values the loop agrees on every micro-batch (the
    stop flag, token counts), so agreeing never waits for the GPU; None when there is one process or the
    default group already is gloo (CPU). Collective: every rank calls it, once, at setup."""
    from torch import distributed  # not `dist`: this module's `dist` is the recipe's distributed section

    if accelerator.num_processes == 1 or not distributed.is_initialized() or distributed.get_backend() == "gloo":
        return None
    return distributed.new_group(backend="gloo")


