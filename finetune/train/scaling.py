"""fp16 loss scaling: the backward and the optimizer step of one training step, through a gradient scaler.

fp16 keeps 5 exponent bits: gradients below 2^-24 flush to zero in the half-precision backward, silently.
The scaler multiplies the loss (and so every gradient) by a large factor before backward, divides it out
before clipping, and skips the optimizer step when a gradient came out inf/nan (lowering the factor).
Under FSDP the scaler is torch's ShardedGradScaler, which all-reduces "found inf" so that every rank skips
the same steps. bf16 and fp32 need no scaling: the same calls pass through unchanged.
"""
from __future__ import annotations

import torch

from finetune.util.log import log


class LossScaler:
    """`scale(loss)` before backward, `unscale(optimizer)` before clipping, `step(optimizer)` instead of
    `optimizer.step()`. `skipped` counts the steps dropped for inf/nan gradients."""

    def __init__(self, mixed_precision: str, device_type: str, sharded: bool, init_scale: float = 2.0 ** 16):
        self.skipped = 0
        self.scaler = None
        if mixed_precision != "fp16":
            return
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device_type, init_scale=init_scale)
        else:
            self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)

    @property
    def enabled(self) -> bool:
        return self.scaler is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.enabled else loss

    def unscale(self, optimizer) -> None:
        """True gradients from here on (clipping and the norm that is logged see unscaled values)."""
        if self.enabled:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer, step: int) -> bool:
        """The optimizer step, unless a gradient is inf/nan; True when the parameters were updated."""
        if not self.enabled:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # update() lowers the scale exactly when this step found inf/nan (and so did not step).
        if self.scaler.get_scale() < before:
            self.skipped += 1
            log.warning(f"fp16: step {step} skipped (inf/nan gradients at loss scale {before:g}); loss scale now "
                        f"{self.scaler.get_scale():g}, {self.skipped} skipped so far")
            return False
        return True

    def scale_value(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.enabled else {}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state:
            self.scaler.load_state_dict(state)
