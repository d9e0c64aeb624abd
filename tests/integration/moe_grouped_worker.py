"""Worker for test_moe_grouped.py: under `torchrun --standalone --nproc_per_node 2`, the grouped 4-bit experts
against the per-expert loop (FINETUNE_MOE_EXPERTS=per_expert) on moe4bit.WIDE under FSDP2 (gloo, fp32), as the
one-process test compares them: one model, wrapped and filled by the loop's own calls (parallel.wrap,
fsdp.fill_shards), so both paths read the same sharded weights; at every step both run forward and backward on
each rank's rows of one global batch, and the step applies the reference's (reduce-scattered) gradients, so
the two are compared along one trajectory.

    torchrun --standalone --nproc_per_node 2 moe_grouped_worker.py OUT STEPS

Then the real loop trains the same model under FSDP2 with the router's balance loss (OUT/balance, `balance_run`).

Rank 0 writes OUT/grouped.json: per path the step losses (the mean over ranks), per step whether top-k routed
alike on both paths on every rank, per step the largest difference of the full (gathered) LoRA gradients,
experts' adapters and the others apart, and the parameter it was found in with its largest gradient element;
and every rank's balance loss of every forward of the balance run.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's finetune, not an installed one

from tests.integration.moe4bit import WIDE  # noqa: E402

PATHS = ("per_expert", "grouped")


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    from finetune.recipe import DistributedSpec, FsdpSpec, LoraSpec, ModelSpec, QuantizationSpec, TrainSpec
    from finetune.train import parallel as D
    from finetune.train.lora import apply_lora
    from finetune.train.optim import build_optimizer
    from finetune.weights.experts import grouped
    from finetune.weights.experts.module import PackedExperts
    from finetune.weights.load.model import load_with_plan
    from finetune.weights.load.placement import placement_for
    from finetune.weights.shard.fsdp import fill_shards

    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    train = TrainSpec(mixed_precision="no", optimizer="adamw_torch", learning_rate=1e-2, max_grad_norm=None)
    acc = D.make_accelerator(DistributedSpec(strategy="fsdp"), FsdpSpec(version=2), train, "float32")
    spec = ModelSpec(name=WIDE, dtype="float32", gradient_checkpointing=False)
    model, plan = load_with_plan(spec, QuantizationSpec(), placement_for(acc), quiet=True)
    model = apply_lora(model, LoraSpec(dropout=0.0, target_parameters="auto"), seed=0)
    model, opt = D.wrap(acc, model, build_optimizer(model.named_parameters(), train), plan)
    fill_shards(model, plan)
    model.train()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    routes: list = []
    for m in model.modules():
        if isinstance(m, PackedExperts):
            m.register_forward_pre_hook(lambda m, args: routes.append(args[1].clone()))
    calls = {p: 0 for p in PATHS}  # grouped.forward's calls under each setting: it ran, and only when asked
    real = grouped.forward

    def counted(*args, **kwargs):
        calls[os.environ[grouped.ENV]] += 1
        return real(*args, **kwargs)

    grouped.forward = counted
    rank, gen = acc.process_index, torch.Generator().manual_seed(5)
    got = {p: {"losses": [], "grads": [], "routes": []} for p in PATHS}
    facts = {"same_routing": [], "experts_diff": [], "other_diff": [], "n_expert_grads": 0}
    for _ in range(steps):
        ids = torch.randint(3, 384, (4, 24), generator=gen)[2 * rank:2 * rank + 2]  # this rank's rows
        for path in PATHS:
            os.environ[grouped.ENV] = path
            opt.zero_grad(set_to_none=True)
            routes.clear()
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            got[path]["losses"].append(acc.reduce(loss.detach(), "mean").item())
            got[path]["grads"] = {n: p.grad.detach().clone() for n, p in trained.items()}  # local shards
            got[path]["routes"] = list(routes)
        same = all(torch.equal(a, b) for a, b in zip(got["per_expert"]["routes"], got["grouped"]["routes"]))
        flag = torch.tensor([float(same)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        facts["same_routing"].append(bool(flag.item()))
        diffs = {"experts": 0.0, "other": 0.0}
        worst = ("", 0.0, 0.0)  # the parameter with the largest difference, and its largest gradient element
        for n in trained:  # every rank gathers every gradient, in one order: full_tensor is collective
            want, have = full(got["per_expert"]["grads"][n]), full(got["grouped"]["grads"][n])
            key, diff = "experts" if ".experts." in n else "other", (have - want).abs().max().item()
            diffs[key] = max(diffs[key], diff)
            if diff > worst[1]:
                worst = (n, diff, want.abs().max().item())
        facts["experts_diff"].append(diffs["experts"])
        facts["other_diff"].append(diffs["other"])
        facts.setdefault("worst", []).append(worst)
        for n, p in trained.items():
            p.grad = got["per_expert"]["grads"][n]
        opt.step()
    facts["n_expert_grads"] = sum(".experts." in n for n in trained)
    facts["losses"] = {p: got[p]["losses"] for p in PATHS}
    facts["grouped_calls"] = calls
    grouped.forward = real
    del model, opt
    facts["balance_by_rank"] = balance_run(out)
    if rank == 0:
        (out / "grouped.json").write_text(json.dumps(facts))
    torch.distributed.barrier()


def balance_run(out: Path) -> list:
    """The real loop under FSDP2 with the router's balance loss (train.router_aux_loss_coef 0.5, fp32, 2 steps of
    2 micro-batches) into OUT/balance; returns every rank's balance loss of every forward, in order (what the
    logged aux_loss must average)."""
    from finetune.recipe import load
    from finetune.train import balance
    from finetune.train.loop import train

    from tests.integration.families import ROOT

    seen, real = [], balance.read_aux
    balance.read_aux = lambda output: seen.append(real(output).item()) or real(output)
    recipe = load(ROOT / "recipes" / "tiny_cpu.yaml", [
        f"model.name={WIDE}", "train.max_steps=2", "train.warmup_steps=0", "train.log_every=1",
        "data.max_samples=32", "data.max_seq_len=32", "output.progress_bar=false", "data.eval_sources=[]",
        "data.eval_split=0", "lora.dropout=0", f"output.dir={out / 'balance'}", "distributed.strategy=fsdp",
        "train.micro_batch_size=2", "train.gradient_accumulation_steps=2", "train.router_aux_loss_coef=0.5",
        "train.mixed_precision=no", "quantization.compute_dtype=float32", "model.gradient_checkpointing=true"])
    train(recipe, out / "balance")
    balance.read_aux = real
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, seen)
    return everyone


if __name__ == "__main__":
    main()
