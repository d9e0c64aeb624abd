"""output.report_to without a run: what validate says, the config the trackers get, the kept run ids."""
import importlib.util
import json

import pytest

from finetune import cli
from finetune import recipe as R
from finetune.train.keepers import trackers as T

TINY = "recipes/tiny_cpu.yaml"


def test_uninstalled_tracker_is_a_validate_error_naming_the_extra(capsys, monkeypatch):
    # A tracker whose module cannot be found here: the real find_spec answers for a name that does not exist.
    monkeypatch.setitem(T.TRACKERS, "trackio", ("finetune_no_such_tracker_module", "trackio"))
    assert cli.main(["validate", TINY, "output.report_to=[trackio]"]) == 2
    out = capsys.readouterr().out
    assert "output.report_to" in out and "pip install 'finetune[trackio]'" in out


def test_installed_tracker_passes_validate(capsys):
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard not installed: pip install 'finetune[tensorboard]'")
    assert cli.main(["validate", TINY, "output.report_to=[tensorboard]"]) == 0
    assert "report_to" not in capsys.readouterr().out


def test_unknown_tracker_is_exit_2_naming_the_field(capsys):
    assert cli.main(["validate", TINY, "output.report_to=[neptune]"]) == 2
    assert "output.report_to" in capsys.readouterr().err


def test_run_config_is_flat_redacted_and_has_recipe_data_and_plan(monkeypatch):
    secret = "sk-Abc123def456ghi789"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    r = R.from_dict({"output": {"dir": f"runs/{secret}"}})
    cfg = T.run_config(r, {"rows": 12, "sources": [{"path": "x", "rows": 12}]})
    assert cfg["recipe.output.dir"] == "runs/***" and secret not in json.dumps(cfg)
    assert cfg["recipe.train.learning_rate"] == r.train.learning_rate and cfg["data.rows"] == 12
    assert json.loads(cfg["data.sources"]) == [{"path": "x", "rows": 12}]
    assert cfg["plan.gpu_bytes_per_device"] > 0
    assert all(isinstance(v, (str, int, float, bool)) for v in cfg.values())


def test_resumed_run_reuses_kept_ids_and_a_fresh_one_does_not(tmp_path):
    state = {"wandb": {"id": "abc"}, "mlflow": {"run_id": "r1"}}
    kw = T.init_kwargs(["tensorboard", "wandb", "mlflow"], tmp_path, state, step=7)
    assert kw["wandb"]["id"] == "abc" and kw["wandb"]["resume"] == "allow" and kw["mlflow"]["run_id"] == "r1"
    assert kw["tensorboard"]["purge_step"] == 8  # events after the resumed step go, as metrics.jsonl's lines do
    fresh = T.init_kwargs(["wandb", "mlflow"], tmp_path, {}, step=0)
    assert fresh["wandb"]["id"] != "abc" and fresh["mlflow"]["run_id"] is None


def test_wandb_without_a_login_is_refused_before_any_weights_load_and_offline_passes(tmp_path, capsys, monkeypatch):
    # It used to pass validate and die in a traceback once the model had loaded. No network: only the environment
    # and the netrc file are read.
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("machine example.com login me password x\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert cli.main(["validate", TINY, "output.report_to=[wandb]"]) == 2
    out = capsys.readouterr().out
    assert "output.report_to: wandb is not logged in here" in out and "WANDB_MODE=offline" in out
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert cli.main(["validate", TINY, "output.report_to=[wandb]"]) == 0
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")  # `wandb login`
    assert cli.main(["validate", TINY, "output.report_to=[wandb]"]) == 0


def test_an_unreachable_mlflow_server_is_refused_and_a_listening_one_passes(capsys, monkeypatch):
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on once closed: refused at once, no network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    assert cli.main(["validate", TINY, "output.report_to=[mlflow]"]) == 2
    out = capsys.readouterr().out
    assert f"MLFLOW_TRACKING_URI=http://127.0.0.1:{port} does not answer" in out and "sqlite:///" in out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{s.getsockname()[1]}")
        assert cli.main(["validate", TINY, "output.report_to=[mlflow]"]) == 0
