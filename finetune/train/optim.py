"""Optimizer and learning-rate schedule from the `train` section.

bitsandbytes' 8-bit AdamW keeps its two moments as uint8 codes plus one fp32 absmax per 256-value
block. Under FSDP2 every parameter and gradient is a DTensor while bnb's kernels take plain tensors
(its quantization maps are plain), so the stock optimizer stops at the first step with "got mixed
torch.Tensor and DTensor" for every tensor big enough to get 8-bit state (>= 4096 elements).
`ShardedAdamW8bit` runs the same bnb kernels on each rank's local shard instead: the update of
AdamW is elementwise, so updating the shards one rank each is the full update, and the state it keeps
is sharded the same way (each rank's tensors sized to its own shard). `state_dict()` therefore holds
plain per-rank tensors: checkpoint it per rank.
"""
from __future__ import annotations

import math

import torch

from finetune.recipe import TrainSpec
from finetune.util.log import log

_notices: set[str] = set()


def _notice_once(msg: str) -> None:
    if msg not in _notices:
        _notices.add(msg)
        log.info(msg)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _update_shard(opt, F, p, config) -> None:
    """bnb's 8-bit (or 32-bit, for small tensors) AdamW update of this rank's local shard of `p`, in place."""
    local, grad = _local(p), _local(p.grad)
    if local.numel() == 0:  # FSDP1 / uneven FSDP2 shards: this rank holds none of p
        return
    # The kernels update `work` in place; a non-contiguous shard is updated on a copy and copied back.
    work = local if local.is_contiguous() else local.contiguous()
    grad = grad.contiguous()
    state = opt.state[p]
    state["step"] += 1
    beta1, beta2 = config["betas"][0], config["betas"][1]
    beta3 = config["betas"][2] if len(config["betas"]) >= 3 else 0.0
    # By keyword: the two kernels take their arguments in different orders, and a reordering in a
    # bitsandbytes release must fail loudly, not update with swapped betas (pinned against the stock
    # optimizer: test_distributed_optim.py::test_sharded_adamw8bit_matches_bitsandbytes_on_plain_tensors).
    common = dict(optimizer_name=opt.optimizer_name, g=grad, p=work, state1=state["state1"], state2=state["state2"],
                  beta1=beta1, beta2=beta2, beta3=beta3, alpha=config.get("alpha", 0.0), eps=config["eps"],
                  step=state["step"], lr=config["lr"], weight_decay=config["weight_decay"], gnorm_scale=1.0,
                  skip_zeros=config["skip_zeros"])
    if state["state1"].dtype == torch.float32:
        F.optimizer_update_32bit(**common, unorm_vec=state["unorm_vec"] if config["max_unorm"] > 0.0 else None,
                                 max_unorm=config["max_unorm"])
    else:
        F.optimizer_update_8bit_blockwise(**common, qmap1=state["qmap1"], qmap2=state["qmap2"],
                                          absmax1=state["absmax1"], absmax2=state["absmax2"])
    if work is not local:
        local.copy_(work)


def _sharded_adamw8bit_cls():
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    class ShardedAdamW8bit(bnb.optim.AdamW8bit):
        """bnb.optim.AdamW8bit (or its paged form) updating each rank's local shard of DTensor
        parameters; plain tensors (one process, DDP, FSDP1's flat-parameter views) go the same way.

        Overrides only bnb's two per-parameter hooks, `init_state` and `update_step`; `step`,
        `state_dict` and `load_state_dict` are bnb's own. Whether a tensor gets 8-bit state is decided
        on its full size (DTensor.numel() is global; FSDP1 views are looked up by the size recorded at
        construction), so sharding never silently turns 8-bit state into 32-bit state.
        """

        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)
            # FSDP1 (use_orig_params) keeps these Parameter objects but shrinks them to this rank's slice.
            self._full_numel = {id(p): p.numel() for g in self.param_groups for p in g["params"]}

        def _full_size(self, p) -> int:
            from torch.distributed.tensor import DTensor

            return p.numel() if isinstance(p, DTensor) else max(self._full_numel.get(id(p), 0), p.numel())

        @torch.no_grad()
        def init_state(self, group, p, gindex, pindex):
            config = self.get_config(gindex, pindex, group)
            local = _local(p)
            state = self.state[p]
            state["step"] = 0
            if config["optim_bits"] == 8 and self._full_size(p) >= config["min_8bit_size"]:
                for name in ("dynamic", "udynamic"):
                    self.name2qmap[name] = self.name2qmap[name].to(local.device)
                state["state1"] = self.get_state_buffer(local, dtype=torch.uint8)
                state["state2"] = self.get_state_buffer(local, dtype=torch.uint8)
                state["qmap1"], state["qmap2"] = self.name2qmap["dynamic"], self.name2qmap["udynamic"]
                blocks = math.ceil(local.numel() / 256)  # bnb's blockwise optimizer block size
                state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=local.device)
                state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=local.device)
            else:
                state["state1"] = self.get_state_buffer(local, dtype=torch.float32)
                state["state2"] = self.get_state_buffer(local, dtype=torch.float32)
            if config["max_unorm"] > 0.0:
                state["unorm_vec"] = torch.zeros((1,), device=local.device)

        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            _update_shard(self, F, p, self.get_config(gindex, pindex, group))

    return ShardedAdamW8bit


_SHARDED_CLS = None


def sharded_adamw8bit_cls():
    """The class (built lazily so importing this module does not import bitsandbytes)."""
    global _SHARDED_CLS
    if _SHARDED_CLS is None:
        _SHARDED_CLS = _sharded_adamw8bit_cls()
    return _SHARDED_CLS


def param_groups(model_or_params, weight_decay: float, lr: float | None = None,
                 loraplus_lr_ratio: float | None = None) -> list[dict]:
    """Trainable parameters in two groups: decay on >= 2-D weights (LoRA A/B), none on vectors (biases,
    DoRA magnitudes).

    With `loraplus_lr_ratio` (LoRA+), each of those splits once more by learning rate: B matrices and
    vectors learn at lr x ratio, the rest (A) at lr, which is peft's LoRA+ grouping
    (peft.optimizers.create_loraplus_optimizer: "lora_B" in the name or a 1-D parameter). Not peft's
    function itself: it builds the optimizer from a whole PeftModel with transformers' decay rule, where
    this keeps our decay rule and takes (name, parameter) pairs. Each group carries `lr`, so the schedule
    scales both rates together and the ratio holds at every step.
    """
    items = model_or_params.named_parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    named = [p if isinstance(p, tuple) else ("", p) for p in items]  # (name, param) pairs or params
    named = [(n, p) for n, p in named if p.requires_grad]
    if not named:
        raise ValueError("no trainable parameters: was LoRA applied?")
    if loraplus_lr_ratio is not None and not all(n for n, _ in named):
        raise ValueError("LoRA+ needs parameter names to find the B matrices: pass a module or (name, param) pairs")
    groups = []
    for decay, keep in ((weight_decay, lambda p: p.dim() >= 2), (0.0, lambda p: p.dim() < 2)):
        chosen = [(n, p) for n, p in named if keep(p)]
        if loraplus_lr_ratio is None:
            groups.append({"params": [p for _, p in chosen], "weight_decay": decay})
            continue
        fast = [p for n, p in chosen if "lora_B" in n or p.dim() == 1]
        slow = [p for n, p in chosen if not ("lora_B" in n or p.dim() == 1)]
        groups.append({"params": slow, "weight_decay": decay, "lr": lr, "lr_ratio": 1.0})
        groups.append({"params": fast, "weight_decay": decay, "lr": lr * loraplus_lr_ratio,
                       "lr_ratio": loraplus_lr_ratio})
    return [g for g in groups if g["params"]]


def build_optimizer(model_or_params, train: TrainSpec, loraplus_lr_ratio: float | None = None) -> torch.optim.Optimizer:
    """The optimizer named by `train.optimizer`, over the trainable parameters of a module, an iterable of
    parameters, or of (name, parameter) pairs.

    Build it on the un-wrapped model and pass it to `parallel.wrap` with the model: FSDP2 swaps
    the parameters, and Accelerate re-points the optimizer at the new ones.
    """
    groups = param_groups(model_or_params, train.weight_decay, train.learning_rate, loraplus_lr_ratio)
    common = dict(lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_epsilon)
    if train.optimizer == "adamw_torch":
        return torch.optim.AdamW(groups, **common)
    paged = train.optimizer == "paged_adamw_8bit"
    if paged and not torch.cuda.is_available():
        # Paging moves optimizer state to CPU RAM under GPU memory pressure (CUDA unified memory).
        _notice_once("optimizer: paged_adamw_8bit pages through CUDA unified memory; no CUDA here, "
                     "so it runs as adamw_8bit (same update, same 8-bit state)")
        paged = False
    return sharded_adamw8bit_cls()(groups, is_paged=paged, **common)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSpec, total_steps: int):
    """Linear warmup over `train.warmup_steps`, then cosine / linear decay to 0 or constant."""
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[train.lr_scheduler]
    return get_scheduler(name, optimizer=optimizer, num_warmup_steps=train.warmup_steps,
                         num_training_steps=total_steps)


def schedule_note(scheduler, step: int, total_steps: int) -> str | None:
    """What a resume does to the learning rate when the run's length changed (train.max_steps or epochs): the
    schedule is recomputed over the new length, so the rate jumps from the checkpoint's value to the new
    schedule's value at this step. None when it continues unchanged."""
    old = scheduler.get_last_lr()[0]
    new = scheduler.lr_lambdas[0](step) * scheduler.base_lrs[0]
    if abs(new - old) <= 1e-6 * max(abs(old), abs(new), 1e-12):
        return None
    return (f"the learning-rate schedule now spans {total_steps} steps: step {step} ran at {old:.3g}, the next "
            f"steps run from {new:.3g} and decay to 0 at step {total_steps}. To go on at a constant rate instead, "
            f"start a new run from this adapter: lora.init_adapter=CHECKPOINT/adapter train.lr_scheduler=constant")
