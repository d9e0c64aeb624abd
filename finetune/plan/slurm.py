"""Build the `accelerate launch` command for one node of a SLURM job.

`scripts/slurm/finetune.sbatch` runs `srun python -m finetune slurm --exec RECIPE` once per node; each copy
reads SLURM's environment (node list, node count, this node's index, GPUs on the node), prints the command
and replaces itself with `accelerate launch ... -m finetune RECIPE`. Node lists are expanded here in
Python, so nothing depends on `scontrol` being on the compute nodes' PATH.

    python -m finetune slurm RECIPE [key=value ...] [--config-file F] [--gpus-per-node N] [--exec]
"""
from __future__ import annotations

import itertools
import re
from typing import Mapping, Sequence

from finetune.recipe import load
from finetune.recipe.contract import process_count_problems
from finetune.util.errors import RecipeError

DEFAULT_PORT = 29500


def _split_top_level(spec: str) -> list[str]:
    """Split on commas that are not inside brackets: `a[1,3],b` -> [`a[1,3]`, `b`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, spec: str) -> list[str]:
    """`01-03,07` -> [01, 02, 03, 07]; zero padding follows the width of the range's first number."""
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise RecipeError([f"SLURM node list {spec!r}: cannot read range {item!r}"])
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise RecipeError([f"SLURM node list {spec!r}: range {item!r} runs backwards"])
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_nodelist(spec: str) -> list[str]:
    """Expand a SLURM hostlist (`gpu[01-03,07],cpu5`, `r[1-2]n[1-2]`) to host names, in SLURM's order."""
    if spec.count("[") != spec.count("]"):
        raise RecipeError([f"SLURM node list {spec!r}: unbalanced brackets"])
    hosts: list[str] = []
    for part in _split_top_level(spec):
        # Alternate literal text and bracket groups; several groups give their cartesian product.
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[p] if i % 2 == 0 else _expand_range(p, spec) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    if not hosts:
        raise RecipeError([f"SLURM node list {spec!r} names no hosts"])
    return hosts


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        if env.get(name, "").strip():
            return env[name].strip()
    return None


def _int(value: str, name: str, problems: list[str]) -> int | None:
    try:
        return int(value)
    except ValueError:
        problems.append(f"{name}={value!r} is not a whole number")
        return None


def _gpus(env: Mapping[str, str], given: int | None, problems: list[str]) -> int | None:
    if given is not None:
        return given
    if (raw := _first(env, "SLURM_GPUS_ON_NODE")) is not None:
        return _int(raw, "SLURM_GPUS_ON_NODE", problems)
    # --gpus-per-node takes `[type:]count`, e.g. `a100:4`.
    if (raw := _first(env, "SLURM_GPUS_PER_NODE")) is not None:
        return _int(raw.rsplit(":", 1)[-1], "SLURM_GPUS_PER_NODE", problems)
    problems.append("GPUs per node unknown: SLURM_GPUS_ON_NODE is not set (request GPUs with "
                    "#SBATCH --gpus-per-node=N) and --gpus-per-node was not given")
    return None


def _port(env: Mapping[str, str], problems: list[str]) -> int | None:
    if (raw := _first(env, "MASTER_PORT")) is not None:
        return _int(raw, "MASTER_PORT", problems)
    if (job := _first(env, "SLURM_JOB_ID")) is not None and job.isdigit():
        # Per-job port so two jobs whose first node is the same host do not collide.
        return 15000 + int(job) % 20000
    return DEFAULT_PORT


def _check_recipe(recipe_path: str, overrides: Sequence[str], machines: int, processes: int) -> None:
    """Fail on the login node, not on every compute node after the weights load."""
    d = load(recipe_path, list(overrides), world=processes).distributed
    problems = []
    if d.num_machines != machines:
        problems.append(f"distributed.num_machines is {d.num_machines} but the job has {machines} nodes "
                        f"(fix: distributed.num_machines={machines})")
    if d.num_processes not in (None, processes):
        problems.append(f"distributed.num_processes is {d.num_processes} but the job runs {processes} "
                        f"(fix: distributed.num_processes={processes} or null)")
    problems += [p.render() for p in process_count_problems(d.strategy, processes, machines)]
    if problems:
        raise RecipeError(problems, recipe_path)


def launch_args(env: Mapping[str, str], recipe_path: str, config_file: str | None,
                gpus_per_node: int | None = None, overrides: Sequence[str] = ()) -> list[str]:
    """The `accelerate launch` argv for this node, from SLURM's environment. Raises RecipeError listing
    every missing or inconsistent variable at once."""
    problems: list[str] = []
    nodelist = _first(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    hosts = expand_nodelist(nodelist) if nodelist else []
    if not nodelist:
        problems.append("SLURM_JOB_NODELIST is not set: run this inside a SLURM allocation (sbatch/salloc + srun)")
    raw_nodes = _first(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nodes = _int(raw_nodes, "SLURM_NNODES", problems) if raw_nodes else len(hosts) or None
    if nodes is not None and hosts and nodes != len(hosts):
        problems.append(f"SLURM_NNODES={nodes} but SLURM_JOB_NODELIST {nodelist!r} names {len(hosts)} hosts")
    # SLURM_NODEID is the node's index in the allocation; SLURM_PROCID equals it with one task per node.
    raw_rank = _first(env, "SLURM_NODEID", "SLURM_PROCID")
    rank = _int(raw_rank, "SLURM_NODEID", problems) if raw_rank else None
    if raw_rank is None:
        problems.append("SLURM_NODEID (or SLURM_PROCID) is not set: start one task per node with srun")
    elif rank is not None and nodes and not 0 <= rank < nodes:
        problems.append(f"machine rank {rank} is outside 0..{nodes - 1}")
    gpus = _gpus(env, gpus_per_node, problems)
    if gpus is not None and gpus < 1:
        problems.append(f"GPUs per node must be at least 1, got {gpus}")
    port = _port(env, problems)
    if problems:
        raise RecipeError(problems, "SLURM environment")
    _check_recipe(recipe_path, overrides, nodes, nodes * gpus)
    main_ip = _first(env, "MASTER_ADDR") or hosts[0]
    args = ["accelerate", "launch"]
    if config_file:
        args += ["--config_file", str(config_file)]
    args += ["--num_machines", str(nodes), "--num_processes", str(nodes * gpus), "--machine_rank", str(rank),
             "--main_process_ip", main_ip, "--main_process_port", str(port),
             "-m", "finetune", str(recipe_path), *overrides]
    return args
