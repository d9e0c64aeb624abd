"""configs/ and launcher_problems, checked against accelerate 1.15 itself: each shipped config loads with
accelerate's config loader, goes through accelerate launch's own argument processing to the environment it
would give the training processes, and that environment must agree with the recipe it was made for."""
import shlex
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

from finetune import cli
from finetune.plan import launcher
from finetune.plan.headers import split_header
from finetune.recipe import from_dict, load

ROOT = Path(__file__).resolve().parents[2]


def launched_env(argv: list[str]) -> dict:
    """The environment `accelerate launch ARGV` hands each process (torchrun adds WORLD_SIZE/LOCAL_WORLD_SIZE)."""
    args = launch_command_parser().parse_args(argv)
    args, _, _ = _validate_launch_command(args)
    if args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
        env["WORLD_SIZE"] = str(args.num_processes)
        env["LOCAL_WORLD_SIZE"] = str(args.num_processes // args.num_machines)
    else:
        env = prepare_simple_launcher_cmd_env(args)[1]
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_", "WORLD", "LOCAL_WORLD"))}


def shipped_recipe(name):
    src, overrides, *_ = launcher.SHIPPED[name]
    return load(ROOT / src, overrides)


@pytest.mark.parametrize("name", sorted(launcher.SHIPPED))
def test_shipped_config_loads_and_agrees_with_its_recipe(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = ROOT / name
    cfg = load_config_from_file(str(path))  # accelerate's loader rejects unknown top-level keys
    r = shipped_recipe(name)
    assert cfg.distributed_type.value == launcher.DISTRIBUTED_TYPE[r.distributed.strategy]
    assert cfg.num_processes == launcher.SHIPPED[name][2]
    # fsdp_config keys are not checked by the loader (launch copies them onto its args): check them
    # against the launch parser's own flags, so a misspelt key cannot silently do nothing.
    known = {a.dest for a in launch_command_parser()._actions}
    assert set(cfg.fsdp_config) <= known
    # A free port for the first machine: accelerate refuses a main_process_port another process holds (the
    # multi-node config's 29500, which a distributed test running beside this one may be using).
    env = launched_env(["--config_file", str(path), "--main_process_port", str(free_port()), "train.py"])
    assert launcher.launcher_problems(r, env) == []


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", sorted(launcher.SHIPPED))
def test_shipped_config_is_what_the_recipe_generates(name):
    assert (ROOT / name).read_text() == launcher.shipped_config_text(name, ROOT), \
        f"{name} drifted; regenerate it with launcher.shipped_config_text"


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_recipe_header_launch_command_gives_an_agreeing_environment(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    _, block, _ = split_header(recipe.read_text())
    line = next((x for x in block if x.startswith("# launch:")), None)
    if line is None or "accelerate launch" not in line:
        pytest.skip("not launched through accelerate")
    argv = shlex.split(line.split("accelerate launch", 1)[1])
    m = argv.index("-m")
    flags = [a for a in argv[:m] if a not in ("--machine_rank", "K", "--main_process_ip", "MAIN_NODE")]
    env = launched_env(flags + ["train.py"])
    assert launcher.launcher_problems(load(recipe), env) == []


FSDP = {"distributed": {"strategy": "fsdp", "num_processes": 2}, "train": {"optimizer": "adamw_torch"}}
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "ACCELERATE_MIXED_PRECISION": "no", "FSDP_OFFLOAD_PARAMS": "false",
            "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


def paths(problems):
    return {p.path for p in problems if p.level == "error"}


def test_agreeing_fsdp_environment_has_no_problems():
    assert launcher.launcher_problems(from_dict(FSDP), FSDP_ENV) == []


@pytest.mark.parametrize("change,path", [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, "distributed.num_processes"),
    ({"ACCELERATE_USE_FSDP": "false"}, "distributed.strategy"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "fsdp.mixed_precision_param_dtype"),
    ({"FSDP_VERSION": "1"}, "fsdp.version"),
    ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp.cpu_offload"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "model.gradient_checkpointing"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_FSDP": "false"}, "distributed.strategy"),
])
def test_disagreeing_fsdp_environment_is_an_error(change, path):
    assert path in paths(launcher.launcher_problems(from_dict(FSDP), {**FSDP_ENV, **change}))


def test_single_recipe_launched_on_many_processes_is_an_error():
    env = {"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert "distributed.strategy" in paths(launcher.launcher_problems(from_dict({}), env))


def test_plain_python_start_of_a_multi_process_recipe_is_an_error():
    assert "distributed.num_processes" in paths(launcher.launcher_problems(from_dict(FSDP), {}))


def test_dynamo_is_a_warning():
    probs = launcher.launcher_problems(from_dict(FSDP), {**FSDP_ENV, "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})
    assert [p.level for p in probs] == ["warning"]


def test_mixed_precision_follows_fsdp_param_dtype_not_autocast():
    assert launcher.expected_mixed_precision(from_dict(FSDP)) == "no"
    bf16 = from_dict({**FSDP, "model": {"dtype": "bfloat16"}, "fsdp": {"mixed_precision_param_dtype": "bfloat16"}})
    assert launcher.expected_mixed_precision(bf16) == "bf16"
    assert launcher.expected_mixed_precision(from_dict({})) == "bf16"  # no FSDP: the autocast dtype


def test_cli_writes_a_loadable_config(tmp_path):
    out = tmp_path / "acc.yaml"
    assert cli.main(["accelerate-config", str(ROOT / "recipes/llama3_70b_qlora.yaml"), "--gpus", "4", "--output",
                     str(out)]) == 0
    cfg = load_config_from_file(str(out))
    assert (cfg.num_processes, cfg.fsdp_config["fsdp_offload_params"]) == (4, True)


def test_cli_rejects_processes_that_do_not_divide_over_machines(capsys):
    assert cli.main(["accelerate-config", str(ROOT / "recipes/llama3_70b_qlora.yaml"), "--gpus", "3",
                     "--machines", "2"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_fsdp1_config_uses_the_sharding_strategy_name():
    r = from_dict({**FSDP, "fsdp": {"version": 1, "sharding_strategy": "SHARD_GRAD_OP"}})
    fc = launcher.accelerate_config(r)["fsdp_config"]
    assert fc["fsdp_reshard_after_forward"] == "SHARD_GRAD_OP" and fc["fsdp_use_orig_params"] is True
    assert yaml.safe_load(yaml.safe_dump(fc)) == fc


def test_launcher_default_precision_is_no_conflict_but_an_explicit_one_is(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    bf16 = from_dict({})  # train.mixed_precision: bf16
    # `accelerate launch` without a config sets ACCELERATE_MIXED_PRECISION=no: the recipe decides.
    assert launcher.launcher_problems(bf16, {"ACCELERATE_MIXED_PRECISION": "no"}) == []
    [p] = launcher.launcher_problems(bf16, {"ACCELERATE_MIXED_PRECISION": "fp16"})
    assert p.level == "error" and p.path == "train.mixed_precision" and "mixed_precision: bf16" in p.fix


def test_strategy_auto_follows_the_process_count(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = from_dict({})
    assert (one.distributed.strategy, one.distributed.from_auto) == ("single", True)
    assert from_dict({"distributed": {"num_processes": 2}}).distributed.strategy == "fsdp"
    assert from_dict({}, world=4).distributed.strategy == "fsdp"
    explicit = from_dict({"distributed": {"strategy": "single"}})
    assert (explicit.distributed.strategy, explicit.distributed.from_auto) == ("single", False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under a launcher
    auto = from_dict({})
    assert auto.distributed.strategy == "fsdp" and auto.fsdp.version == 2
    # accelerate's default multi-GPU launch (no FSDP config): fine for auto, a conflict for an explicit fsdp.
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "no"}
    assert launcher.launcher_problems(auto, env) == []
    explicit_fsdp = from_dict({"distributed": {"strategy": "fsdp"}})
    assert "distributed.strategy" in paths(launcher.launcher_problems(explicit_fsdp, env))
    # `accelerate-config --gpus 2` plans the FSDP run for an auto recipe.
    monkeypatch.delenv("WORLD_SIZE")
    r = load(ROOT / "recipes" / "tiny_cpu.yaml", world=2)
    assert launcher.accelerate_config(r, 2)["distributed_type"] == "FSDP"
