"""The MoE router's load-balancing loss (`train.router_aux_loss_coef`): the auxiliary loss the model family
defines (Switch Transformer's, as transformers' Mixtral and Qwen3-MoE compute it from every layer's router
logits), added to the training loss with the recipe's weight and logged as `aux_loss`.

finetune never hands the model its labels (the chunked head computes the cross-entropy), so the model's own
`loss + coef * aux_loss` is not what trains: the forward is asked for `output_router_logits` and its public
`aux_loss` output is read (finetune.train.loss.token_losses), and the step adds it (finetune.train.step).
A coefficient of 0 leaves the forward exactly as without this module: the router logits are not even asked for.
"""
from __future__ import annotations

from finetune.plan import router
from finetune.util.errors import Problem, RecipeError


def model_config(model):
    """The config that holds the MoE fields (a multimodal model's text config, else the model's own)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "text_config", None) or cfg


def has_balance_loss(model) -> bool:
    """Whether the model family defines the router's balance loss (its config carries the coefficient)."""
    cfg = model_config(model)
    return cfg is not None and getattr(cfg, "router_aux_loss_coef", None) is not None


def coefficient(train_spec, model) -> float:
    """The weight of the balance loss in this run: the recipe's, or (null) the model config's own; 0 on a
    dense model, where an explicit positive weight is bad input (`validate` says so first)."""
    wanted = train_spec.router_aux_loss_coef
    if not has_balance_loss(model):
        if wanted:
            raise RecipeError([f"train.router_aux_loss_coef: {wanted}, but {type(model).__name__} has no MoE router. "
                               "Fix: leave it null (or 0) for a dense model"])
        return 0.0
    return float(model_config(model).router_aux_loss_coef if wanted is None else wanted)


def read_aux(output) -> "torch.Tensor":  # noqa: F821
    """The model output's balance loss (a 0-d tensor on the graph). A family that was asked for its router
    logits and returned no `aux_loss` is a code error, not bad input."""
    aux = getattr(output, "aux_loss", None)
    if aux is None or isinstance(aux, (int, float)):
        raise RuntimeError(f"{type(output).__name__} carries no aux_loss although output_router_logits was asked "
                           "for: the model family does not compute the router's balance loss")
    return aux


def words(train_spec, coef: float) -> str:
    """One line for the run's log: the balance loss's weight (`coefficient`, worked out once by the run) and
    where it comes from."""
    source = "the model config's" if train_spec.router_aux_loss_coef is None else "train.router_aux_loss_coef"
    return (f"MoE router balance: loss + {coef:g} x aux_loss ({source}; logged as aux_loss; "
            "train.router_aux_loss_coef: 0 turns it off)")


def problems(r, arch) -> list[Problem]:
    """validate's rules, from config.json alone: a positive weight on a dense model is refused (it has no router,
    nothing would be trained); a balance loss under reentrant checkpointing is refused (the checkpointed layers
    run their forward without autograd there, so their router logits would carry no gradient)."""
    wanted = r.train.router_aux_loss_coef
    if not arch.experts:
        if wanted:
            return [Problem(level="error", path="train.router_aux_loss_coef",
                            message=f"{wanted}, but {arch.model_type} is a dense model: it has no MoE router to balance",
                            fix="leave it null (or 0) for a dense model")]
        return []
    coef = router.coefficient(arch, wanted)  # null: the config's own, as the run will read it
    m = r.model
    if coef and m.reentrant_checkpointing and m.gradient_checkpointing not in (False, 0):
        return [Problem(level="error", path="train.router_aux_loss_coef",
                        message=f"{coef} (the router's balance loss) with model.reentrant_checkpointing: the "
                                "checkpointed layers' router logits carry no gradient there",
                        fix="set model.reentrant_checkpointing: false, or train.router_aux_loss_coef: 0")]
    return []
