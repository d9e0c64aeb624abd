"""The Accelerate launcher side of a recipe: write the matching launcher YAML, and check a running
launcher's environment against the recipe before any weights load.

The recipe is the single source of truth; the launcher YAML is derived from it (`finetune accelerate-config`),
and `launcher_problems` catches the drift when someone launches a recipe with another config.

Mixed precision means two different things to Accelerate: with FSDP it is also the dtype FSDP casts
*parameters* to, which would corrupt packed 4-bit storage kept in fp32. So under FSDP the launcher's
`mixed_precision` follows `fsdp.mixed_precision_param_dtype` (null: `no`), and bf16 compute comes from the
recipe's own autocast (`train.mixed_precision`). Without FSDP it is the autocast dtype itself.

Key names follow accelerate 1.15 (`accelerate/commands/config/cluster.py`, `utils/launch.py`): FSDP2 takes a
boolean `fsdp_reshard_after_forward`, FSDP1 takes the sharding strategy name in the same key. Rank-0 loading
(`fsdp_cpu_ram_efficient_loading`, `fsdp_sync_module_states`) is written off: the streaming loader replaces it.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from finetune.recipe import Recipe, load
from finetune.recipe.contract import process_count_problems
from finetune.util.errors import Problem, RecipeError

DISTRIBUTED_TYPE = {"single": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP"}
PARAM_DTYPE_TO_MP = {None: "no", "float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def expected_mixed_precision(r: Recipe) -> str:
    if r.distributed.strategy == "fsdp":
        return PARAM_DTYPE_TO_MP[r.fsdp.mixed_precision_param_dtype]
    return r.train.mixed_precision


def layer_classes(r: Recipe) -> list[str]:
    if r.fsdp.transformer_layer_cls:
        return list(r.fsdp.transformer_layer_cls)
    try:  # from the model's config.json or the built-in table; no weights, no transformers import
        from finetune.plan.archs import resolve

        return [resolve(r.model.name)[0].layer_class]
    except ValueError:
        return []


def fsdp_config(r: Recipe) -> dict:
    f = r.fsdp
    cfg: dict = {"fsdp_version": f.version}
    if f.auto_wrap_policy == "transformer":
        cfg["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        # Without an explicit list Accelerate wraps the model's own `_no_split_modules`, right for every
        # transformers model, so one config serves Llama, Mistral and Qwen recipes alike.
        if f.transformer_layer_cls:
            cfg["fsdp_transformer_layer_cls_to_wrap"] = ",".join(f.transformer_layer_cls)
    else:
        cfg["fsdp_auto_wrap_policy"] = "SIZE_BASED_WRAP"
        cfg["fsdp_min_num_params"] = f.min_num_params
    if f.version == 2:
        reshard = f.reshard_after_forward
        cfg["fsdp_reshard_after_forward"] = (f.sharding_strategy != "SHARD_GRAD_OP") if reshard is None else reshard
    else:
        cfg["fsdp_reshard_after_forward"] = f.sharding_strategy
        cfg["fsdp_backward_prefetch"] = "NO_PREFETCH" if f.backward_prefetch == "NONE" else f.backward_prefetch
        cfg["fsdp_forward_prefetch"] = f.forward_prefetch
        cfg["fsdp_use_orig_params"] = f.use_orig_params
    cfg["fsdp_offload_params"] = f.cpu_offload
    # Off: the streaming loader is the one reader per machine, and training passes them off to Accelerate
    # whatever the launcher says (train/parallel.fsdp_plugin_kwargs); written so the file says what happens.
    cfg["fsdp_cpu_ram_efficient_loading"] = False
    cfg["fsdp_sync_module_states"] = False
    cfg["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"
    # transformers already checkpoints each layer (model.gradient_checkpointing); FSDP's own wrapper on top
    # would recompute twice.
    cfg["fsdp_activation_checkpointing"] = False
    return cfg


def accelerate_config(r: Recipe, gpus: int | None = None, machines: int | None = None,
                      cpu: bool = False) -> dict:
    """The launcher YAML (as a dict) for this recipe. `gpus` is the total process count."""
    d = r.distributed
    machines = machines or d.num_machines
    procs = gpus or d.num_processes or (1 if d.strategy == "single" else machines)
    problems = [p.render() for p in process_count_problems(d.strategy, procs, machines)]
    if problems:
        raise RecipeError(problems, "--gpus/--machines")
    cfg = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": DISTRIBUTED_TYPE[d.strategy],
           "downcast_bf16": "no", "enable_cpu_affinity": False, "machine_rank": 0, "main_training_function": "main",
           "mixed_precision": expected_mixed_precision(r), "num_machines": machines, "num_processes": procs,
           "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
           "tpu_use_sudo": False, "use_cpu": cpu}
    if machines > 1:
        cfg["main_process_ip"] = "main-node"  # replace with the first machine's address
        cfg["main_process_port"] = 29500
    if d.strategy == "fsdp":
        cfg["fsdp_config"] = fsdp_config(r)
    return cfg


HEADER = "# Accelerate launcher config generated from "  # how accelerate-config knows its own files


def render_config(r: Recipe, cfg: dict, source: str = "RECIPE") -> str:
    head = [f"{HEADER}{source}",
            f"#   by: python -m finetune accelerate-config {source} --gpus {cfg['num_processes']}"
            + (f" --machines {cfg['num_machines']}" if cfg["num_machines"] > 1 else ""),
            f"# launch: accelerate launch --config_file THIS_FILE -m finetune {source}"]
    if cfg["distributed_type"] == "FSDP":
        head.append("# mixed_precision is FSDP's parameter cast here: 'no' keeps the packed 4-bit storage intact;")
        head.append("# bf16 compute comes from the recipe's train.mixed_precision (autocast).")
    if cfg["num_machines"] > 1:
        head.append("# On each machine pass --machine_rank K (0 on the main node) and set main_process_ip.")
    return "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False)


# ---------------------------------------------------------------------------------------------------
# The shipped configs/ and the launch command of a recipe

_FSDP_BASE = ["distributed.strategy=fsdp", "distributed.num_processes=2", "train.optimizer=adamw_torch"]
# config file -> (recipe it is generated from, overrides, total processes, machines, cpu)
SHIPPED = {
    "configs/single_gpu.yaml": ("recipes/llama3_8b_qlora.yaml", [], 1, 1, False),
    "configs/ddp.yaml": ("recipes/llama3_8b_qlora.yaml", ["distributed.strategy=ddp", "distributed.num_processes=2"],
                         2, 1, False),
    "configs/fsdp.yaml": ("recipes/llama3_8b_qlora.yaml", _FSDP_BASE, 2, 1, False),
    # FSDP1 flattens one dtype per wrapped module: fp32 LoRA needs the frozen weights in fp32 too.
    "configs/fsdp1.yaml": ("recipes/llama3_8b_qlora.yaml", _FSDP_BASE + ["fsdp.version=1", "model.dtype=float32"],
                           2, 1, False),
    "configs/multi_node.yaml": ("recipes/llama3_70b_qlora.yaml", ["distributed.num_processes=16",
                                "distributed.num_machines=2", "fsdp.cpu_offload=false"], 16, 2, False),
    "configs/cpu_fsdp.yaml": ("recipes/tiny_cpu_fsdp.yaml", [], 2, 1, True),
}


def shipped_config_text(name: str, root: Path = Path(".")) -> str:
    src, overrides, procs, machines, cpu = SHIPPED[name]
    r = load(root / src, overrides)
    shown = src + "".join(f" {o}" for o in overrides)
    text = render_config(r, accelerate_config(r, procs, machines, cpu=cpu), shown)
    if cpu:
        text = text.replace("use_cpu: true", "use_cpu: true  # no GPU: accelerate still starts the processes "
                            "through torchrun; the toolkit builds its Accelerator for CPU")
    return text


def choose_config(r: Recipe, cpu: bool = False) -> str:
    d = r.distributed
    if cpu and d.strategy != "single":
        return "configs/cpu_fsdp.yaml"
    if d.num_machines > 1:
        return "configs/multi_node.yaml"
    if d.strategy == "fsdp":
        return "configs/fsdp.yaml" if r.fsdp.version == 2 else "configs/fsdp1.yaml"
    return "configs/ddp.yaml" if d.strategy == "ddp" else "configs/single_gpu.yaml"


def _cli_value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def launch_command(r: Recipe, recipe_path: str, root: Path = Path("."), cpu: bool = False) -> str:
    """`accelerate launch` with the shipped config that fits, plus a flag for each setting where this
    recipe differs from the config (command-line flags win over the config file)."""
    name = choose_config(r, cpu)
    base = yaml.safe_load((root / name).read_text()) if (root / name).exists() else {}
    want = accelerate_config(r, cpu=cpu)
    flags = []
    for key in ("num_processes", "num_machines", "mixed_precision"):
        if base.get(key) != want[key] or key == "num_processes" and want[key] > 1:
            flags.append(f"--{key} {_cli_value(want[key])}")
    for key, value in want.get("fsdp_config", {}).items():
        if base.get("fsdp_config", {}).get(key) != value:
            flags.append(f"--{key} {_cli_value(value)}")
    if want["num_machines"] > 1:
        flags.append("--machine_rank K --main_process_ip MAIN_NODE")
    return " ".join(["accelerate launch --config_file", name] + flags + ["-m finetune", recipe_path])


# ---------------------------------------------------------------------------------------------------
# Running launcher vs recipe


def _flag(env, key: str) -> bool | None:
    v = env.get(key)
    return None if v is None else v.strip().lower() in ("1", "true", "yes")


def _launched_type(env) -> str:
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if _flag(env, "ACCELERATE_USE_FSDP"):
        return "FSDP"
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        return "DEEPSPEED"
    return "MULTI_GPU" if world > 1 else "NO"


def launcher_problems(r: Recipe, env=None) -> list[Problem]:
    """Compare the environment `accelerate launch` (or torchrun) set up with what the recipe plans."""
    env = os.environ if env is None else env
    out: list[Problem] = []
    d = r.distributed
    world = int(env.get("WORLD_SIZE", "1") or 1)
    kind = _launched_type(env)
    regen = "generate the launcher config with `python -m finetune accelerate-config RECIPE`"
    if kind == "DEEPSPEED":
        out.append(Problem(level="error", path="distributed.strategy", message="launched with DeepSpeed, which this "
                           "toolkit does not drive", fix=f"launch with an FSDP or DDP config; {regen}"))
    elif d.strategy == "fsdp" and kind != "FSDP" and world > 1 and not d.from_auto:
        # (With strategy auto the recipe left the choice to the process count; the Accelerator is built
        # with the FSDP plugin whatever the launcher's distributed type, e.g. accelerate's default multi-GPU.)
        out.append(Problem(level="error", path="distributed.strategy",
                           message=f"recipe shards with FSDP but the launcher set up {kind} "
                                   f"(ACCELERATE_USE_FSDP unset): every process would hold the whole model",
                           fix=f"launch with configs/fsdp.yaml; {regen}"))
    elif d.strategy != "fsdp" and kind == "FSDP":
        out.append(Problem(level="error", path="distributed.strategy",
                           message=f"launcher is FSDP (ACCELERATE_USE_FSDP=true) but the recipe says {d.strategy}",
                           fix=f"set distributed.strategy: fsdp, or launch with configs/{'ddp' if d.strategy == 'ddp' else 'single_gpu'}.yaml"))
    elif d.strategy == "single" and world > 1:
        out.append(Problem(level="error", path="distributed.strategy",
                           message=f"recipe runs one process but {world} were launched (WORLD_SIZE={world})",
                           fix="set distributed.strategy: fsdp or ddp, or launch one process"))
    elif d.strategy in ("fsdp", "ddp") and world == 1 and d.num_processes not in (None, 1):
        out.append(Problem(level="error", path="distributed.num_processes",
                           message=f"recipe plans {d.num_processes} processes but this is a single process "
                                   "(no WORLD_SIZE): was it started with python instead of accelerate launch?",
                           fix=f"accelerate launch --config_file configs/{'fsdp' if d.strategy == 'fsdp' else 'ddp'}.yaml "
                               "-m finetune RECIPE"))
    if d.num_processes and world > 1 and world != d.num_processes:
        out.append(Problem(level="error", path="distributed.num_processes",
                           message=f"recipe plans {d.num_processes} processes, the launcher started {world} "
                                   "(WORLD_SIZE)", fix=f"launch with --num_processes {d.num_processes}, or set "
                                                        f"distributed.num_processes: {world}"))
    local = env.get("LOCAL_WORLD_SIZE")
    if local and world == d.num_processes and int(local) * d.num_machines != d.num_processes:
        out.append(Problem(level="error", path="distributed.num_machines",
                           message=f"{local} processes per machine x {d.num_machines} machines != "
                                   f"{d.num_processes} processes", fix="make num_processes = per-machine x machines"))
    out += _mixed_precision_problems(r, env, kind)
    if kind == "FSDP" and d.strategy == "fsdp":
        out += _fsdp_env_problems(r, env)
    backend = (env.get("ACCELERATE_DYNAMO_BACKEND") or "no").lower()
    if backend not in ("no", "none", ""):
        out.append(Problem(level="warning", path="launcher.dynamo_backend",
                           message=f"torch.compile (ACCELERATE_DYNAMO_BACKEND={backend}) graph-breaks on "
                                   "bitsandbytes 4-bit layers and peft adapters: slower, not faster",
                           fix="set dynamo_config.dynamo_backend: NO in the launcher config"))
    return out


def _mixed_precision_problems(r: Recipe, env, kind: str) -> list[Problem]:
    got = env.get("ACCELERATE_MIXED_PRECISION")
    # "no" is also what `accelerate launch` sets when no config names a precision; the Accelerator is
    # built with mixed_precision="no" whatever the launcher says, so the recipe decides precision.
    if got is None or got.strip().lower() == "no":
        return []
    want = expected_mixed_precision(r)
    if got.lower() == want:
        return []
    cast_to = {"bf16": "bfloat16", "fp16": "float16", "no": None}.get(got.lower(), got)
    if kind == "FSDP" and cast_to in (None, r.effective_quant_storage()):
        return [Problem(level="warning", path="fsdp.mixed_precision_param_dtype",
                        message=f"launcher mixed_precision={got}, the recipe plans {want}: FSDP's parameter "
                                "cast differs (the 4-bit storage is not affected)",
                        fix=f"set mixed_precision: {want} in the launcher config")]
    if kind == "FSDP":
        return [Problem(level="error", path="fsdp.mixed_precision_param_dtype",
                        message=f"launcher mixed_precision={got} makes FSDP cast parameters (the packed 4-bit "
                                f"storage in {r.effective_quant_storage()}) to {got}; the recipe plans {want}",
                        fix=f"set mixed_precision: {want} in the launcher config (autocast still computes in "
                            f"{r.train.mixed_precision})")]
    return [Problem(level="error", path="train.mixed_precision",
                    message=f"launcher mixed_precision={got}, recipe train.mixed_precision={want}",
                    fix=f"set mixed_precision: {want} in the launcher config, or train.mixed_precision: {got}")]


def _fsdp_env_problems(r: Recipe, env) -> list[Problem]:
    f, out = r.fsdp, []
    version = env.get("FSDP_VERSION")
    if version and int(version) != f.version:
        out.append(Problem(level="error", path="fsdp.version", message=f"launcher FSDP_VERSION={version}, recipe "
                           f"fsdp.version={f.version}", fix=f"set fsdp_version: {f.version} in the launcher config"))
    checks = [("FSDP_OFFLOAD_PARAMS", f.cpu_offload, "fsdp.cpu_offload", "fsdp_offload_params")]
    if f.version == 1:
        checks.append(("FSDP_USE_ORIG_PARAMS", f.use_orig_params, "fsdp.use_orig_params", "fsdp_use_orig_params"))
    for key, want, path, yaml_key in checks:
        got = _flag(env, key)
        if got is not None and got != want:
            out.append(Problem(level="error", path=path, message=f"launcher {key}={env[key]}, recipe {path}={want}",
                               fix=f"set {yaml_key}: {str(want).lower()} in the launcher config"))
    if _flag(env, "FSDP_ACTIVATION_CHECKPOINTING") and r.model.gradient_checkpointing:
        out.append(Problem(level="error", path="model.gradient_checkpointing",
                           message="both FSDP (FSDP_ACTIVATION_CHECKPOINTING) and transformers checkpoint each layer: "
                                   "every layer would be recomputed twice",
                           fix="set fsdp_activation_checkpointing: false in the launcher config"))
    wrap = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    classes = layer_classes(r)
    if wrap and classes and set(w.strip() for w in wrap.split(",")) != set(classes):
        out.append(Problem(level="warning", path="fsdp.transformer_layer_cls",
                           message=f"launcher wraps {wrap}, the recipe's model has {','.join(classes)}",
                           fix="regenerate the launcher config, or set fsdp.transformer_layer_cls"))
    return out
