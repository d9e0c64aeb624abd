"""train.router_aux_loss_coef as validate reads it (finetune.train.balance.problems): a negative weight, a weight
on a dense model and a balance loss under reentrant checkpointing are bad input (exit 2, the field named); an
MoE model takes any weight, null (its config's own) included."""
from finetune import cli

from ..conftest import ROOT

TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
MOE = "model.name=synthetic:Qwen/Qwen3-30B-A3B?layers=2&hidden=64&experts=8&experts_per_tok=2"


def _errors(overrides):
    from finetune import recipe as R
    from finetune.train import preflight as V

    problems = V.model_problems(R.load(TINY, overrides))[0]
    return [p for p in problems if p.level == "error" and p.path == "train.router_aux_loss_coef"]


def test_a_negative_weight_is_refused_with_the_field_named(capsys):
    assert cli.main(["validate", TINY, "train.router_aux_loss_coef=-0.01"]) == 2
    err = capsys.readouterr().err
    assert "train.router_aux_loss_coef" in err and "Traceback" not in err


def test_a_dense_model_refuses_a_weight_and_takes_null_or_zero():
    got = _errors(["train.router_aux_loss_coef=0.01"])
    assert len(got) == 1 and "dense" in got[0].message, got
    assert _errors([]) == [] and _errors(["train.router_aux_loss_coef=0"]) == []


def test_an_moe_model_takes_a_weight_but_not_under_reentrant_checkpointing():
    assert _errors([MOE, "train.router_aux_loss_coef=0.01"]) == [] and _errors([MOE]) == []
    reentrant = [MOE, "model.reentrant_checkpointing=true", "model.gradient_checkpointing=true"]
    got = _errors(reentrant)  # null: the config's own weight, positive
    assert len(got) == 1 and "reentrant" in got[0].message, got
    assert _errors([*reentrant, "train.router_aux_loss_coef=0"]) == []
    assert _errors([*reentrant, "model.gradient_checkpointing=false"]) == []
