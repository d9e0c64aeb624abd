"""Preference tuning (train.method dpo | orpo): the losses on per-sequence log-probs, the forward that gives
those log-probs, and the per-micro-batch loss the optimizer step backpropagates.

A preference batch (data.batching.collate_pairs) holds B pairs as 2B sequences, the chosen then the rejected,
so both sides of a pair go through the model in one forward. Each sequence's log-prob is the sum over its
answer tokens of the per-token log-probs, which the chunked output head (train.loss) returns without ever
holding [tokens x vocab] logits.

DPO (Rafailov et al. 2023), the sigmoid loss: -log sigmoid(beta x ((c - c_ref) - (r - r_ref))) per pair,
with label smoothing eps: (1 - eps) x that + eps x the same for the flipped pair (conservative DPO), and
optionally `dpo_sft_weight` x the mean NLL of the chosen answers' tokens (RPO).
ORPO (Hong et al. 2024), reference-free: the mean NLL of the chosen answers' tokens minus lambda x the mean
of log sigmoid(log odds(chosen) - log odds(rejected)), odds from the per-token average log-probs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from finetune.data import encode
from finetune.train.loss import batch_kernels, device_batch, token_losses

# Summed per micro-batch, reduced over ranks once per step, divided by "pairs" for the metrics line.
# prefers / logp_margin: the policy's own preference (summed log-prob of chosen above rejected), which needs
# no reference: `finetune eval` and the benchmark report it as preference accuracy and margin.
STAT_KEYS = ("pairs", "rewards_chosen", "rewards_rejected", "margin", "accuracy", "log_odds", "nll_tokens", "nll",
             "prefers", "logp_margin")


def dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0):
    """(loss per pair, chosen rewards, rejected rewards); rewards = beta x (log pi - log pi_ref), detached."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    z = beta * (chosen_ratio - rejected_ratio)
    losses = -F.logsigmoid(z)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-z)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: expm1 near 0, log1p far from it (Maechler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_odds(chosen_mean, rejected_mean):
    """(log sigmoid of the log odds ratio, the log odds ratio) per pair, from the answers' per-token mean
    log-probs: odds(y) = p / (1 - p), so log odds = log p - log(1 - p)."""
    c, r = chosen_mean.float(), rejected_mean.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return F.logsigmoid(log_odds), log_odds


def sequence_logps(model, batch: dict, device_type: str, train_spec, offload=None, aux: list | None = None):
    """(summed log-prob of each sequence's scored tokens [2B], their count [2B]) in one forward (`aux`: an
    MoE router's balance loss appended, as finetune.train.loss.token_losses does)."""
    if "rows" not in batch:
        batch = device_batch(batch, batch["labels"].device)
    losses, _ = token_losses(model, batch, device_type, train_spec, offload, aux=aux)
    labels = batch["labels"]
    scored = labels[:, 1:] != encode.IGNORE  # the positions token_losses scored, in the same row-major order
    # each scored position's sequence, from the flat positions worked out on the host (no wait for the GPU)
    seq = torch.div(batch["rows"], labels.size(1), rounding_mode="floor")
    logps = torch.zeros(labels.size(0), dtype=torch.float32, device=losses.device).index_add(0, seq, -losses.float())
    return logps, scored.sum(1)


def pair_units(batch: dict) -> tuple[int, int]:
    """(pairs, scored tokens of the chosen answers) of a preference batch: what a step's loss is divided by."""
    pairs = batch["input_ids"].size(0) // 2
    return pairs, int((batch["labels"][:pairs, 1:] != encode.IGNORE).sum())


def pair_loss(model, batch: dict, device_type: str, train_spec, offload=None, norm=(1.0, 1.0), aux=None):
    """(the micro-batch's share of the step loss, the detached sums of STAT_KEYS): `pair_losses` of the
    batch's per-sequence log-probs, from one forward of its 2B sequences (`aux`: see sequence_logps)."""
    logps, counts = sequence_logps(model, batch, device_type, train_spec, offload, aux)
    return pair_losses(logps, counts, batch.get("ref_logps"), train_spec, norm)


def pair_losses(logps, counts, ref_logps, train_spec, norm=(1.0, 1.0)):
    """The loss of B pairs from their 2B summed log-probs `logps` (chosen then rejected), the scored tokens
    `counts` of each and (DPO) the reference's `ref_logps`: the pair losses summed and divided by norm[0]
    (the step's pairs), plus for ORPO the chosen answers' NLL summed and divided by norm[1] (the step's
    chosen tokens). Returns (loss, the detached sums of STAT_KEYS)."""
    b = logps.size(0) // 2
    chosen, rejected = logps[:b], logps[b:]
    stats = {"pairs": torch.tensor(float(b), device=logps.device)}
    if train_spec.method == "dpo":
        ref = ref_logps.to(logps.device, logps.dtype)
        losses, rc, rr = dpo_losses(chosen, rejected, ref[:b], ref[b:], train_spec.beta, train_spec.label_smoothing)
        loss = losses.sum() / norm[0]
        if train_spec.dpo_sft_weight:
            nll = -chosen.sum()
            loss = loss + train_spec.dpo_sft_weight * nll / norm[1]
            stats.update(nll=nll.detach(), nll_tokens=counts[:b].sum().to(logps.dtype))
    else:
        counts = counts.clamp(min=1).to(logps.dtype)
        chosen_mean, rejected_mean = chosen / counts[:b], rejected / counts[b:]
        ratio, log_odds = orpo_odds(chosen_mean, rejected_mean)
        nll = -chosen.sum()
        loss = nll / norm[1] - train_spec.orpo_lambda * ratio.sum() / norm[0]
        # TRL's ORPO rewards: lambda x the mean log-prob of each answer
        rc, rr = train_spec.orpo_lambda * chosen_mean.detach(), train_spec.orpo_lambda * rejected_mean.detach()
        stats.update(log_odds=log_odds.detach().sum(), nll=nll.detach(), nll_tokens=counts[:b].sum())
    stats.update(rewards_chosen=rc.sum(), rewards_rejected=rr.sum(), margin=(rc - rr).sum(),
                 accuracy=(rc > rr).float().sum(), prefers=(chosen > rejected).float().sum(),
                 logp_margin=(chosen - rejected).detach().sum())
    return loss, stats


def step_metrics(totals: dict) -> dict:
    """The metrics line of a step from its STAT_KEYS sums over micro-batches and ranks."""
    pairs = max(totals.get("pairs", 0.0), 1.0)
    out = {k: round(totals[k] / pairs, 6) for k in ("rewards_chosen", "rewards_rejected", "margin", "accuracy")}
    if "log_odds" in totals:  # ORPO
        out["log_odds"] = round(totals["log_odds"] / pairs, 6)
    if totals.get("nll_tokens"):  # ORPO, and DPO with dpo_sft_weight
        out["nll"] = round(totals["nll"] / totals["nll_tokens"], 6)
    return out


@torch.no_grad()
def eval_totals(model, batches, device_type: str, train_spec, max_batches=None, device=None) -> dict:
    """Held-out pairs: the STAT_KEYS sums plus "loss" (the pair losses summed; ORPO's NLL enters per pair as
    the batch's mean over chosen tokens)."""
    totals: dict = {}
    for i, b in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        b = device_batch(b, device)
        with batch_kernels(b, device_type, train_spec):
            pairs, chosen_tokens = pair_units(b)
            loss, stats = pair_loss(model, b, device_type, train_spec, norm=(1.0, max(chosen_tokens, 1) / pairs))
        stats["loss"] = loss
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return totals
