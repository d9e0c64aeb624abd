"""The whole preflight, before any weights load or any GPU is paid for (`finetune validate`, and training).

Pure rules (settings that contradict each other) live in `recipe.contract_problems`. This module adds what
depends on the world outside the recipe: the model's shapes (config.json or the built-in table), the
launcher's environment, whether flash-attn and GPUs are there, and whether the plan fits in memory.
Training calls `preflight` with the same rules before it loads weights; it also checks that the output
directory can be written and its disk holds the checkpoints the recipe keeps (finetune.plan.disk).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
from dataclasses import replace

from finetune.plan import checkpointing as C
from finetune.plan import estimate as E
from finetune.plan.disk import output_problems
from finetune.plan.launcher import launcher_problems
from finetune.recipe import Recipe, contract_problems
from finetune.recipe.init_adapter import init_adapter_problems
from finetune.train import balance
from finetune.train.kernels import kernel_problems
from finetune.train.keepers.trackers import tracker_problems
from finetune.util.errors import Problem
from finetune.util.units import fmt

LAUNCH_VARS = ("WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION")


def _launched(env) -> bool:
    return any(k in env for k in LAUNCH_VARS)


def gpu_nodes_present() -> bool:
    """An NVIDIA or ROCm device node exists (a GPU is installed, whether or not torch can use it)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def cuda_facts() -> tuple[int, bool, int | None]:
    """(device count, bf16 supported, memory of device 0 in bytes). torch is imported (seconds) only when it
    already is, or when an NVIDIA or ROCm device node exists: on machines without GPUs validate stays quick."""
    if "torch" not in sys.modules and not gpu_nodes_present():
        return 0, False, None
    import torch

    if not torch.cuda.is_available():
        return 0, False, None
    from finetune.train.machine import bf16_native

    # Not torch.cuda.is_bf16_supported(): it is True on a T4 (7.5) too, where bf16 is emulated and slow.
    return (torch.cuda.device_count(), bf16_native(torch.cuda.get_device_capability(0)),
            torch.cuda.get_device_properties(0).total_memory)


def _path_like(name: str) -> bool:
    """A local path, not a hub id (`org/name`): transformers would read a file there as a config or send a
    missing path to the hub as a malformed repository id."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.path.isfile(os.path.expanduser(name))


def model_problems(r: Recipe) -> tuple[list[Problem], object]:
    """Problems found from the model's shapes; also returns the Arch (or None)."""
    from finetune.plan.archs import resolve

    name = r.model.name
    if _path_like(name) and not os.path.isdir(os.path.expanduser(name)):
        what = "is a file" if os.path.exists(os.path.expanduser(name)) else "does not exist"
        return [Problem(level="error", path="model.name", message=f"{name} {what}; a local model is a directory "
                        "with config.json and weights", fix="give that directory, or a hub id such as org/name")], None
    try:
        arch, _ = resolve(name)
    except (ValueError, OSError) as e:
        return [Problem(level="warning", path="model.name", message=f"cannot read its shapes: {e}",
                        fix="put the model in the HF cache or give a local directory; memory is not checked")], None
    out = []
    targets = r.lora.target_modules
    if isinstance(targets, list):
        names = {x.name for x in arch.linears()}
        missing = [t for t in targets if t not in names and t not in ("lm_head", "embed_tokens")]
        if missing:
            out.append(Problem(level="error", path="lora.target_modules",
                               message=f"{', '.join(missing)} not in a {arch.model_type} layer (it has "
                                       f"{', '.join(sorted(names))})", fix="use those names, or all-linear"))
    k = r.model.gradient_checkpointing
    if type(k) is int and k > arch.layers:
        out.append(Problem(level="error", path="model.gradient_checkpointing",
                           message=f"{k} layers, but {name} has {arch.layers} decoder layers",
                           fix=f"at most {arch.layers} (true checkpoints all), or auto"))
    return out + expert_problems(r, arch) + balance.problems(r, arch), arch


def expert_problems(r: Recipe, arch) -> list[Problem]:
    """lora.target_parameters against the model's fused MoE experts, and peft's no-dropout and no-DoRA rules
    for them."""
    wanted, have = r.lora.target_parameters, [x.name for x in arch.expert_params()]
    if wanted == "auto":
        adapted = have
    else:
        adapted = [t for t in wanted if t in have or f"experts.{t}" in have]
        unknown = [t for t in wanted if t not in adapted]
        if unknown:
            return [Problem(level="error", path="lora.target_parameters",
                            message=f"{', '.join(unknown)} not a fused expert parameter of {arch.model_type} "
                                    f"(it has {', '.join(have) or 'none: a dense model'})",
                            fix="use those names, auto, or []")]
    if adapted and r.lora.use_dora:
        return [Problem(level="error", path="lora.use_dora",
                        message=f"{arch.model_type} has fused MoE expert parameters ({', '.join(adapted)}), which "
                                "peft adapts without DoRA (its ParamWrapper refuses use_dora)",
                        fix="set lora.target_parameters: [] to leave the experts frozen, or lora.use_dora: false")]
    if adapted and r.lora.dropout > 0:
        return [Problem(level="error", path="lora.dropout",
                        message=f"{r.lora.dropout} with adapted MoE experts: peft's ParamWrapper (LoRA on a fused "
                                "expert parameter) cannot apply dropout", fix="set lora.dropout: 0, or "
                                "lora.target_parameters: [] to leave the experts frozen")]
    return []


def code_problems(r: Recipe) -> list[Problem]:
    """A model whose config maps to its own Python code (`auto_map`) runs that code when loaded: only
    with model.trust_remote_code. Pickle-only weights are refused at load time (model.allow_pickle)."""
    from finetune.plan.archs import find_config

    try:
        cfg, where = find_config(r.model.name)
    except (ValueError, OSError):
        return []
    if not cfg or not cfg.get("auto_map") or r.model.trust_remote_code:
        return []
    # Imported only here (seconds): a model that ships code is rare.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    code = ", ".join(sorted(map(str, cfg["auto_map"])))
    if cfg.get("model_type") in CONFIG_MAPPING_NAMES:
        return [Problem(level="warning", path="model.trust_remote_code",
                        message=f"{where} ships its own Python code ({code}); it is not run: transformers' built-in "
                                f"{cfg['model_type']} implementation is used", fix="nothing, unless you need that code")]
    return [Problem(level="error", path="model.trust_remote_code",
                    message=f"{where} needs the model's own Python code ({code}), which would run on load",
                    fix="read that code, then set model.trust_remote_code: true if you trust it")]


def refuse_remote_code(r: Recipe) -> None:
    """The same rule for the verbs that load the model or its tokenizer without the preflight (`generate`,
    `eval`, `data`): exit 2 naming model.trust_remote_code, where transformers would raise a traceback."""
    from finetune.util.errors import RecipeError

    bad = [p.render() for p in code_problems(r) if p.level == "error"]
    if bad:
        raise RecipeError(bad)


def environment_problems(r: Recipe, env, launched: bool) -> list[Problem]:
    out: list[Problem] = []
    m, d = r.model, r.distributed
    # Training has torch loaded already (asking is cheap then); `validate` asks only when it must.
    needs_gpu_info = (launched or m.attn_implementation == "flash_attention_2" or d.backend == "nccl"
                      or "torch" in sys.modules
                      or m.activation_offloading)
    count, bf16_ok, _ = cuda_facts() if needs_gpu_info else (None, None, None)
    if m.activation_offloading and not count:
        # Offloading moves activations from device memory to pinned host memory; on a CPU run they are in
        # host memory already, so it would only add copies (and pinning needs CUDA).
        out.append(Problem(level="error", path="model.activation_offloading",
                           message="activation offloading moves activations from GPU to CPU memory; this machine "
                                   "has no CUDA GPU, so there is nothing to offload", fix="set it to false on CPU"))
    if m.attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None or not count:
            why = "no CUDA GPU" if not count else "the flash-attn package is not installed"
            out.append(Problem(level="warning", path="model.attn_implementation",
                               message=f"flash_attention_2 requested but {why}: training falls back to sdpa",
                               fix="set model.attn_implementation: sdpa (or install flash-attn on a CUDA machine)"))
    if not count and gpu_nodes_present():
        from finetune.train.machine import cuda_unusable_reason

        why = cuda_unusable_reason()
        if why:  # training would stop here too (make_accelerator); say it before any weights load
            message, _, fix = why.partition(". Fix: ")
            out.append(Problem(level="error", path="device", message=message, fix=fix))
    if d.backend == "nccl" and not count:
        out.append(Problem(level="error", path="distributed.backend", message="nccl needs CUDA GPUs and none is "
                           "visible", fix="set distributed.backend: auto (gloo on CPU)"))
    if launched and count:
        local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
        if local > count:
            out.append(Problem(level="error", path="distributed.num_processes",
                               message=f"{local} processes on this machine but only {count} GPU(s)",
                               fix=f"launch at most {count} processes per machine"))
    if count and r.train.mixed_precision == "bf16" and not bf16_ok:
        out.append(Problem(level="error", path="train.mixed_precision",
                           message="this GPU has no native bf16 (compute capability below 8.0, e.g. T4, V100)",
                           fix="set train.mixed_precision: fp16, quantization.compute_dtype: float16, model.dtype: "
                               "float32 and lora.dtype: float32 (fp16 trains with loss scaling)"))
    if launched:
        out += launcher_problems(r, env)
    return out


def _fit_fixes(s: E.Setup, arch, budget: int) -> str:
    """Concrete ways to fit, each checked by re-planning."""
    fixes = []
    for b in range(s.micro_batch - 1, 0, -1):
        if E.build(replace(s, micro_batch=b), arch, "").gpu_bytes_per_device <= budget:
            fixes.append(f"train.micro_batch_size: {b} (raise gradient_accumulation_steps to keep the batch)")
            break
    trials = [("model.gradient_checkpointing: true", dict(checkpointing=True)),
              ("fsdp.cpu_offload: true", dict(offload=True, strategy="fsdp")),
              (f"distributed.num_processes: {2 * s.world} (strategy fsdp)", dict(gpus=2 * s.world, strategy="fsdp")),
              (f"data.max_seq_len: {s.seq_len // 2}", dict(seq_len=s.seq_len // 2))]
    for text, change in trials:
        if all(getattr(s, k) == v for k, v in change.items()):
            continue
        if E.build(replace(s, **change), arch, "").gpu_bytes_per_device <= budget:
            fixes.append(text)
    return "; or ".join(fixes) if fixes else "use GPUs with more memory"


def machine_ram() -> int | None:
    """This machine's physical RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def run_device(r: Recipe, path=None, gpu_memory: int | None = None, env=None) -> str:
    """"cpu" when the run is one of CPU processes, whose activations and working set live in RAM: its recipe's
    plan header says so (`planned for: 1 x cpu`), or no GPU memory is given, no GPU is installed here and the
    model is small enough to train on a CPU (here_problems' rule); else "cuda"."""
    from finetune.plan.archs import resolve
    from finetune.plan.headers import planned_device

    env = os.environ if env is None else env
    declared = planned_device(path) if path else None
    if declared or gpu_memory or gpu_nodes_present():
        return declared or "cuda"
    try:
        params = resolve(r.model.name)[0].params()
    except (ValueError, OSError):
        return "cuda"
    return "cpu" if params <= CPU_PARAMS_LIMIT or env.get(ALLOW_CPU) == "1" else "cuda"


def checkpointing_plan(r: Recipe, arch, gpus: int | None, gpu_memory: int | None, device: str = "cuda",
                       cpu_memory: int | None = None):
    """The plan of the run and its gradient-checkpointing choice (plan.checkpointing: `auto` fitted to
    `gpu_memory`, or on a CPU run to `cpu_memory`, or model.max_memory_gib below either)."""
    s = replace(E.from_recipe(r), device=device)
    if gpus:
        s = replace(s, gpus=gpus)
        if gpus > 1 and s.strategy == "single":
            s = replace(s, strategy="fsdp")
    s = replace(s, gpu_memory=gpu_memory)
    return C.fit(s, arch, "", C.budget(cpu_memory if device == "cpu" else gpu_memory, r.model.max_memory_gib))


def memory_problems(r: Recipe, arch, gpus: int | None, gpu_memory: int | None, cpu_memory: int | None,
                    device: str = "cuda") -> list[Problem]:
    if device == "cpu":  # the RAM is the device: the machine's, unless --cpu-memory says otherwise
        gpu_memory, cpu_memory = None, cpu_memory or machine_ram()
    else:
        gpu_memory = C.budget(gpu_memory, r.model.max_memory_gib)  # the recipe's cap is the memory it plans for
    plan, _ = checkpointing_plan(r, arch, gpus, gpu_memory, device, cpu_memory)
    s = plan.setup
    out = []
    if gpu_memory and plan.gpu_bytes_per_device > gpu_memory:
        out.append(Problem(level="error", path="train.micro_batch_size",
                           message=f"planned {fmt(plan.gpu_bytes_per_device)} per GPU (micro-batch {s.micro_batch} x "
                                   f"{s.seq_len} tokens on {s.world} GPU(s)) does not fit in {fmt(gpu_memory)}",
                           fix=_fit_fixes(s, arch, gpu_memory)))
    if gpu_memory and plan.load_gpu > gpu_memory:
        out.append(Problem(level="error", path="distributed.num_processes",
                           message=f"loading: planned {fmt(plan.load_gpu)} per GPU while the base loads (on {s.world} "
                                   f"GPU(s)) does not fit in {fmt(gpu_memory)}: short by "
                                   f"{fmt(plan.load_gpu - gpu_memory)}",
                           fix="shard the base over more GPUs (distributed.strategy: fsdp, more processes), or use "
                               "GPUs with more memory"))
    if cpu_memory and plan.cpu_bytes_peak > cpu_memory:
        phase = max(plan.cpu, key=plan.cpu.get)
        cpu_steps = device == "cpu" and phase == "training"  # activations of micro-batch x seq_len in RAM
        out.append(Problem(level="error", path="model.name" if phase == "loading" else "train.micro_batch_size"
                           if cpu_steps else "fsdp.cpu_offload", message=f"planned {fmt(plan.cpu_bytes_peak)} of CPU "
                           f"RAM while {phase}" + (f" (a CPU run: micro-batch {s.micro_batch} x {s.seq_len} tokens)"
                                                   if cpu_steps else "")
                           + f" does not fit in {fmt(cpu_memory)}: short by {fmt(plan.cpu_bytes_peak - cpu_memory)}",
                           fix="lower train.micro_batch_size (raise train.gradient_accumulation_steps to keep the batch) or "
                               "data.max_seq_len, or set model.gradient_checkpointing: true" if cpu_steps
                           else _cpu_fix(r, phase)))
    return out


def _cpu_fix(recipe: Recipe, phase: str) -> str:
    """Only suggest switches that are still off; otherwise the machine needs more memory."""
    off = []
    if phase == "loading":  # one reader per machine already holds one tensor at a time: nothing to switch
        return "use machines with more RAM (or add swap), or fewer processes per machine"
    if recipe.fsdp.cpu_offload:
        if phase == "training_start":  # FSDP1's first-forward spike (plan.pinned); FSDP2 pins one tensor at a time
            return ("set fsdp.version: 2 (FSDP1 holds each shard three times until its first forward ends), or "
                    "fsdp.cpu_offload: false (if the GPUs can hold the shards), or add RAM/swap")
        off.append("fsdp.cpu_offload: false (if the GPUs can hold the shards)")
    return ("set " + " and ".join(off) + ", or add RAM/swap") if off else "use machines with more RAM (or add swap)"


def preflight(recipe: Recipe, gpus: int | None = None, gpu_memory: int | None = None, *, env=None,
              launched: bool | None = None, cpu_memory: int | None = None, device: str = "cuda") -> list[Problem]:
    """Every problem with this recipe here and now: contract, model shapes, launcher environment, GPUs,
    memory fit. `gpus` is the total process count (default: the recipe's, or the launcher's); `gpu_memory`
    the bytes of one GPU (default: the visible GPU's when launched). Errors first."""
    env = os.environ if env is None else env
    launched = _launched(env) if launched is None else launched
    out = list(contract_problems(recipe))
    found, arch = model_problems(recipe)
    out += found
    out += code_problems(recipe)
    out += init_adapter_problems(recipe)
    out += tracker_problems(recipe.output.report_to, env)
    out += environment_problems(recipe, env, launched)
    if launched and gpus is None and env.get("WORLD_SIZE"):
        gpus = int(env["WORLD_SIZE"])
    if launched and gpu_memory is None:
        gpu_memory = cuda_facts()[2]
    if recipe.train.kernels != "none":  # the family from the shapes, the GPU from the machine
        out += kernel_problems(recipe.train.kernels, getattr(arch, "model_type", None), cuda_facts()[0])
    if arch is not None:
        out += memory_problems(recipe, arch, gpus, gpu_memory, cpu_memory, device)
    # Unwritable output or too little disk for the checkpoints: found now, not at the first save hours in.
    out += output_problems(recipe, arch, gpus or recipe.distributed.num_processes or 1)
    return sorted(out, key=lambda p: p.level != "error")


def render(problems: list[Problem]) -> str:
    return "\n".join(f"{p.level}: {p.render()}" for p in problems)


CPU_PARAMS_LIMIT = 1_000_000_000  # above this a CPU step takes minutes to hours: a GPU recipe, not a CPU run
ALLOW_CPU = "FINETUNE_ALLOW_CPU"


def weights_problem(r: Recipe, cache_dir: str | None = None) -> Problem | None:
    """A hub model whose weights are not in the local cache. Training reads them offline (HF_HUB_OFFLINE):
    without this check the first launch retried the hub for about 50 s and ended in accelerate's traceback."""
    from finetune.util.synthetic_names import is_synthetic

    name = r.model.name
    if name.startswith("builtin:") or is_synthetic(name) or os.path.isdir(os.path.expanduser(name)):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = snapshot_download(name, revision=r.model.revision, local_files_only=True, cache_dir=cache_dir)
    except (LocalEntryNotFoundError, OSError, ValueError):
        snap = None
    if snap and glob.glob(os.path.join(snap, "*.safetensors")):
        return None
    revision = f" --revision {r.model.revision}" if r.model.revision else ""
    return Problem(level="error", path="model.name",
                   message=f"the weights of {name} are not in the local Hugging Face cache ({cache_dir or HF_HUB_CACHE}); "
                           "training reads them offline and downloads nothing",
                   fix=f"fetch them once where there is network: hf download {name}{revision} (or give a local "
                       "directory as model.name)")


def here_problems(r: Recipe, env=None) -> list[Problem]:
    """What training needs from this machine before it starts: the weights on disk, and a GPU for a model
    too large for CPU training (unless FINETUNE_ALLOW_CPU=1 says a CPU run is meant)."""
    from finetune.plan.archs import resolve

    env = os.environ if env is None else env
    out = [p for p in (weights_problem(r),) if p]
    if cuda_facts()[0] or env.get(ALLOW_CPU) == "1":
        return out
    try:
        params = resolve(r.model.name)[0].params()
    except (ValueError, OSError):
        return out
    if params > CPU_PARAMS_LIMIT:
        out.append(Problem(level="error", path="device",
                           message=f"no GPU here, and {r.model.name} has {params / 1e9:.1f}B parameters: on CPU a "
                                   "step would take minutes to hours",
                           fix=f"launch it on a GPU machine (the recipe's header has the command), or set "
                               f"{ALLOW_CPU}=1 to train on this CPU anyway"))
    return out
