"""DPO and ORPO losses against TRL 1.16 as the oracle: the same per-token log-probs go into our loss and into
TRL's own loss code (DPOTrainer._compute_loss, ORPOTrainer.odds_ratio_loss, called on stand-ins for the
trainer and the model), and the losses and their gradients must agree to 1e-6. Then one whole batch through
the tiny model: our chunked per-sequence log-probs against TRL's from full logits (get_batch_logps)."""
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from finetune.recipe import TrainSpec
from finetune.train.preference import pair_losses

B, T = 5, 9


def _per_token(seed=0):
    """[2B, T-1] per-token log-probs (leaf, requires grad) and the [2B, T] completion mask: chosen then rejected."""
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(2 * B, T - 1, generator=g, dtype=torch.float64) * 3).requires_grad_()
    mask = torch.zeros(2 * B, T, dtype=torch.long)
    for i in range(2 * B):
        start = 2 + i % 3
        mask[i, start: T - i % 2] = 1  # prompts of different lengths, some answers end before padding
    return logps, mask


def _ours(logps, mask, spec, ref=None):
    scored = mask[:, 1:].bool()
    summed = (logps * scored).sum(1)
    counts = scored.sum(1)
    pairs, chosen_tokens = B, int(scored[:B].sum())
    return pair_losses(summed, counts, ref, spec, norm=(pairs, chosen_tokens))


def _trl_dpo(logps, mask, ref, beta, losses=("sigmoid",), weights=(1.0,)):
    from trl.trainer.dpo_trainer import DPOTrainer

    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    fake = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=acc, aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                           loss_types=list(losses), loss_weights=list(weights), beta=beta, label_smoothing=0.0,
                           use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1)
    shift = mask[:, 1:]
    zeros = torch.zeros_like(logps)

    def model(**kwargs):  # TRL's fused head returns per-token log-probs, 0 where the label is -100
        return SimpleNamespace(log_probs=logps * shift, entropy=zeros, mean_logits=zeros.detach(),
                               is_top1=torch.zeros_like(shift, dtype=torch.bool))

    inputs = {"input_ids": torch.ones(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T),
              "completion_mask": mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    return DPOTrainer._compute_loss(fake, model, inputs, return_outputs=False), fake._metrics["train"]


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_and_gradient_equal_trl(beta):
    logps, mask = _per_token()
    ref = -torch.rand(2 * B, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 10
    ours, stats = _ours(logps, mask, TrainSpec(method="dpo", beta=beta), ref)
    (g_ours,) = torch.autograd.grad(ours, logps)
    theirs, metrics = _trl_dpo(logps, mask, ref, beta)
    (g_theirs,) = torch.autograd.grad(theirs, logps)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert torch.allclose(g_ours, g_theirs, atol=1e-6, rtol=0)
    assert g_ours.abs().sum() > 0
    for ours_key, trl_key in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                              ("margin", "rewards/margins"), ("accuracy", "rewards/accuracies")):
        assert abs(stats[ours_key].item() / B - metrics[trl_key][0]) < 1e-6, ours_key


@pytest.mark.parametrize("weight", [0.5, 2.0])
def test_dpo_with_an_sft_term_equals_trl_sigmoid_plus_sft(weight):
    """train.dpo_sft_weight w is TRL's loss_type [sigmoid, sft] with loss_weights [1, w] (RPO)."""
    logps, mask = _per_token(3)
    ref = -torch.rand(2 * B, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 10
    ours, stats = _ours(logps, mask, TrainSpec(method="dpo", beta=0.1, dpo_sft_weight=weight), ref)
    (g_ours,) = torch.autograd.grad(ours, logps)
    theirs, _ = _trl_dpo(logps, mask, ref, 0.1, ("sigmoid", "sft"), (1.0, weight))
    (g_theirs,) = torch.autograd.grad(theirs, logps)
    plain, _ = _ours(logps, mask, TrainSpec(method="dpo", beta=0.1), ref)
    assert abs(ours.item() - plain.item()) > 0.1  # the term is there
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert torch.allclose(g_ours, g_theirs, atol=1e-6, rtol=0)
    nll = -(logps[:B] * mask[:B, 1:]).sum() / mask[:B, 1:].sum()
    assert abs(stats["nll"].item() / stats["nll_tokens"].item() - nll.item()) < 1e-9


def test_dpo_label_smoothing_is_conservative_dpo():
    """TRL 1.16's sigmoid loss has no label smoothing; the smoothed loss is cDPO's closed form."""
    logps, mask = _per_token(2)
    ref = torch.zeros(2 * B, dtype=torch.float64)
    eps, beta = 0.2, 0.3
    ours, _ = _ours(logps, mask, TrainSpec(method="dpo", beta=beta, label_smoothing=eps), ref)
    summed = (logps * mask[:, 1:]).sum(1)
    z = beta * (summed[:B] - summed[B:])
    expected = (-(1 - eps) * torch.nn.functional.logsigmoid(z) - eps * torch.nn.functional.logsigmoid(-z)).mean()
    assert abs(ours.item() - expected.item()) < 1e-9


def test_orpo_loss_and_gradient_equal_trl():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    lam = 0.25
    logps, mask = _per_token(3)
    ours, stats = _ours(logps, mask, TrainSpec(method="orpo", orpo_lambda=lam))
    (g_ours,) = torch.autograd.grad(ours, logps)

    scored = mask[:, 1:].bool()
    mean = (logps * scored).sum(1) / scored.sum(1)  # TRL's get_batch_logps(average_log_prob=True)
    fake = SimpleNamespace(beta=lam, accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards, _, log_odds = ORPOTrainer.odds_ratio_loss(fake, mean[:B], mean[B:])
    # The SFT term on the chosen answers: their tokens' mean NLL (TRL's cross_entropy_loss over those labels).
    nll = -logps[:B][scored[:B]].mean()
    theirs = nll - losses.mean()
    (g_theirs,) = torch.autograd.grad(theirs, logps)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert torch.allclose(g_ours, g_theirs, atol=1e-6, rtol=0)
    assert abs(stats["log_odds"].item() / B - log_odds.item()) < 1e-6
    assert abs(stats["rewards_chosen"].item() / B - chosen_rewards.mean().item()) < 1e-6
    assert abs(stats["rewards_rejected"].item() / B - rejected_rewards.mean().item()) < 1e-6


def test_split_over_micro_batches_sums_to_the_whole():
    """Each micro-batch's share (divided by the step's pairs and chosen tokens) adds up to the step's loss."""
    logps, mask = _per_token(4)
    spec = TrainSpec(method="orpo")
    scored = mask[:, 1:].bool()
    summed, counts = (logps * scored).sum(1), scored.sum(1)
    whole, _ = pair_losses(summed, counts, None, spec, norm=(B, int(scored[:B].sum())))
    parts = 0
    for idx in ([0, 1], [2, 3, 4]):
        sel = torch.tensor(idx + [i + B for i in idx])
        part, _ = pair_losses(summed[sel], counts[sel], None, spec, norm=(B, int(scored[:B].sum())))
        parts = parts + part
    assert abs(whole.item() - parts.item()) < 1e-12


def test_chunked_sequence_logps_equal_trl_full_logits(tok):
    """A whole batch through the builtin tiny model: per-sequence log-probs from our chunked head (no full
    logits) against TRL's get_batch_logps on the model's full logits, and the DPO loss of both."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    from finetune.data.batching import collate_pairs
    from finetune.data.encode import encode_pair
    from finetune.recipe import DataSpec
    from finetune.train.preference import sequence_logps
    from finetune.util import builtin
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(builtin.model_dir(), dtype=torch.float32).eval()
    rows = [builtin.preference_row(r) for r in builtin.make_rows(6, seed=5)]
    batch = collate_pairs([encode_pair(r, tok, DataSpec(max_seq_len=64)) for r in rows], tok.pad_token_id)
    spec = TrainSpec(method="dpo", mixed_precision="no", loss_chunk_tokens=7)  # several chunks
    with torch.no_grad():
        ours, _ = sequence_logps(model, batch, "cpu", spec)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    theirs = ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=False)
    assert torch.allclose(ours, theirs.float(), atol=1e-4, rtol=0)
    ref = theirs.detach() - 0.5
    loss_ours, _ = pair_losses(ours.double(), None, ref.double(), spec, norm=(6, 1))
    loss_theirs, _ = pair_losses(theirs.double(), None, ref.double(), spec, norm=(6, 1))
    assert abs(loss_ours.item() - loss_theirs.item()) < 1e-4
