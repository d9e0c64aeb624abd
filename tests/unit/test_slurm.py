"""SLURM -> `accelerate launch` arguments, against faked SLURM environments."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune import cli
from finetune.plan.slurm import expand_nodelist, launch_args
from finetune.util.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a,b[8-10]", ["a", "b8", "b9", "b10"]),
    ("gpu-[098-101]", ["gpu-098", "gpu-099", "gpu-100", "gpu-101"]),
    ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
    ("x[1]-ib", ["x1-ib"]),
    ("h1.cluster.org,h2.cluster.org", ["h1.cluster.org", "h2.cluster.org"]),
])
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu[01-03", "gpu[a-c]", "gpu[5-2]", ""])
def test_bad_nodelist_is_a_recipe_error(spec):
    with pytest.raises(RecipeError, match="node list"):
        expand_nodelist(spec)


@pytest.fixture
def recipe(tmp_path):
    def write(**distributed):
        p = tmp_path / "r.yaml"
        p.write_text(yaml.safe_dump({"distributed": {"strategy": "fsdp", **distributed}}))
        return str(p)
    return write


def _env(**kw):
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2",
           "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_GPUS_ON_NODE": "4"}
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


def _opt(args, flag):
    return args[args.index(flag) + 1]


def test_launch_args_second_node(recipe):
    args = launch_args(_env(), recipe(num_machines=2), "configs/fsdp.yaml", overrides=["train.max_steps=5"])
    assert args[:2] == ["accelerate", "launch"]
    assert _opt(args, "--num_machines") == "2"
    assert _opt(args, "--num_processes") == "8"  # accelerate takes the total over all machines
    assert _opt(args, "--machine_rank") == "1"
    assert _opt(args, "--main_process_ip") == "gpu01"
    assert _opt(args, "--main_process_port") == str(15000 + 4242 % 20000)
    assert _opt(args, "--config_file") == "configs/fsdp.yaml"
    assert args[-4:] == ["-m", "finetune", recipe(num_machines=2), "train.max_steps=5"]
    # accelerate's own parser reads them back as intended.
    from accelerate.commands.launch import launch_command_parser
    ns = launch_command_parser().parse_args(args[2:])
    assert (ns.num_machines, ns.num_processes, ns.machine_rank, ns.main_process_ip, ns.module) == \
        (2, 8, 1, "gpu01", True)
    assert ns.training_script == "finetune" and ns.training_script_args[0].endswith("r.yaml")


def test_every_node_agrees_on_the_main_process(recipe):
    r = recipe(num_machines=3)
    runs = [launch_args(_env(SLURM_JOB_NODELIST="n[7,9],m2", SLURM_NNODES="3", SLURM_NODEID=str(i),
                             SLURM_PROCID=str(i)), r, None) for i in range(3)]
    assert {_opt(a, "--main_process_ip") for a in runs} == {"n7"}
    assert [_opt(a, "--machine_rank") for a in runs] == ["0", "1", "2"]
    assert len({_opt(a, "--main_process_port") for a in runs}) == 1
    assert "--config_file" not in runs[0]


def test_fallbacks_and_explicit_values(recipe):
    env = _env(SLURM_NODEID=None, SLURM_NNODES=None, SLURM_GPUS_ON_NODE=None, SLURM_GPUS_PER_NODE="a100:8",
               MASTER_ADDR="10.0.0.5", MASTER_PORT="29400")
    args = launch_args(env, recipe(num_machines=2), None)
    assert _opt(args, "--machine_rank") == "1"          # from SLURM_PROCID
    assert _opt(args, "--num_machines") == "2"          # counted from the node list
    assert _opt(args, "--num_processes") == "16"        # from SLURM_GPUS_PER_NODE's count
    assert _opt(args, "--main_process_ip") == "10.0.0.5"
    assert _opt(args, "--main_process_port") == "29400"
    assert _opt(launch_args(env, recipe(num_machines=2), None, gpus_per_node=2), "--num_processes") == "4"


def test_missing_slurm_environment_lists_every_problem(recipe):
    with pytest.raises(RecipeError) as e:
        launch_args({}, recipe(num_machines=2), None)
    text = e.value.render()
    assert "SLURM_JOB_NODELIST is not set" in text
    assert "SLURM_NODEID" in text and "GPUs per node unknown" in text
    assert len(e.value.problems) == 3


@pytest.mark.parametrize("change, message", [
    (dict(SLURM_NNODES="3"), "names 2 hosts"),
    (dict(SLURM_NODEID="2", SLURM_PROCID="2"), "outside 0..1"),
    (dict(SLURM_GPUS_ON_NODE="four"), "not a whole number"),
    (dict(SLURM_GPUS_ON_NODE="0"), "at least 1"),
    (dict(MASTER_PORT="x"), "MASTER_PORT"),
])
def test_inconsistent_environment(recipe, change, message):
    with pytest.raises(RecipeError, match=message):
        launch_args(_env(**change), recipe(num_machines=2), None)


def test_recipe_must_match_the_allocation(recipe):
    with pytest.raises(RecipeError) as e:
        launch_args(_env(), recipe(num_machines=1, num_processes=4), None)
    assert any("num_machines is 1 but the job has 2 nodes" in p for p in e.value.problems)
    assert any("num_processes is 4 but the job runs 8" in p for p in e.value.problems)
    with pytest.raises(RecipeError, match="no such file"):
        launch_args(_env(), "missing.yaml", None)


def test_main_prints_the_command(recipe, monkeypatch, capsys):
    r = recipe(num_machines=2)
    for k, v in _env().items():
        monkeypatch.setenv(k, v)
    assert cli.main(["slurm", r, "lora.r=8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("accelerate launch --num_machines 2 --num_processes 8 --machine_rank 1 ")
    assert out.strip().endswith(f"-m finetune {r} lora.r=8")


def test_command_line_exits_2_without_traceback_outside_slurm(recipe):
    bad = subprocess.run([sys.executable, "-m", "finetune", "slurm", recipe(num_machines=2)],
                         env={"PATH": "/usr/bin:/bin"}, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "SLURM_JOB_NODELIST is not set" in bad.stderr


def test_sbatch_script_runs_one_launcher_per_node():
    text = (ROOT / "scripts" / "slurm" / "finetune.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in text
    assert "srun" in text and "python -m finetune slurm --exec" in text
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "slurm" / "finetune.sbatch")]).returncode == 0
