"""A run whose gradients are infinite from the first step (lora.alpha 1e30 makes the adapter's update overflow)
stops with exit 3 (a run error, not bad input) naming the step, saves nothing of it and exports no adapter; with clipping off, the
trained weights themselves are checked."""
from types import SimpleNamespace

import pytest
import torch
import yaml

from finetune import cli
from finetune.train.guard import assert_finite_adapter, check_step
from finetune.util.errors import RunError

pytestmark = pytest.mark.slow


def test_a_diverged_run_stops_and_publishes_nothing(tmp_path, capsys, max_grad_norm=1.0):
    run = tmp_path / "run"
    recipe = {"model": {"gradient_checkpointing": False}, "lora": {"alpha": 1e30},
              "data": {"max_seq_len": 64, "max_samples": 64, "eval_split": 0},
              "train": {"micro_batch_size": 8, "max_steps": 4, "save_every": 1, "log_every": 1,
                        "optimizer": "adamw_torch", "max_grad_norm": max_grad_norm},
              "output": {"dir": str(run), "progress_bar": False}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert cli.main([str(tmp_path / "r.yaml")]) == 3  # a run error, not bad input
    err = capsys.readouterr().err
    assert "training diverged at step 1" in err and "Traceback" not in err, err
    assert not (run / "adapter").exists() and not (run / "checkpoints").exists()


def test_without_clipping_the_trained_weights_are_checked():
    """No gradient norm without clipping: the guard looks at the trained parameters themselves."""
    model = torch.nn.Linear(2, 2)
    run = SimpleNamespace(model=model, step=3)
    check_step(run, 1.5, None)  # finite: nothing happens
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(RunError, match="diverged at step 3"):
        check_step(run, 1.5, None)
    model.weight.requires_grad_(False)  # frozen weights are not the adapter's business
    check_step(run, 1.5, None)


def test_a_non_finite_adapter_is_never_published():
    with pytest.raises(RunError, match="NaN/inf"):
        assert_finite_adapter({"a.lora_A.weight": torch.ones(2), "a.lora_B.weight": torch.tensor([1.0, float("nan")])})
    assert_finite_adapter({"a.lora_A.weight": torch.ones(2)})
