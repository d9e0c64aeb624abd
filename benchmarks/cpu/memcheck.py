"""Measure the tiny 4-bit + LoRA model on CPU and compare with the planner (tests and benchmarks call this).

What is measured, and how:
- weights: bytes of the packed 4-bit parameters, of their quant states (absmax, nested absmax, offset,
  code), of the unquantized parameters and of the LoRA tensors, read from the loaded model;
- gradients: bytes of `.grad` after one backward pass;
- optimizer state: bytes of bitsandbytes' AdamW8bit state after one step (8-bit moments with their absmax
  for tensors of 4096 elements or more, fp32 moments below that);
- activations: every tensor autograd saves for backward during one forward pass, caught with
  `torch.autograd.graph.saved_tensors_hooks`, each storage counted once and parameters left out. With
  non-reentrant checkpointing the hooks see what the checkpoints keep (each layer's input); the layer
  recomputed in backward is measured by the same hooks on a run without checkpointing.
"""
from __future__ import annotations

import contextlib
import itertools

from finetune.plan import estimate as E
from finetune.plan.archs import from_config


def build_model(r: int = 16, dropout: float = 0.05):
    """The builtin tiny Llama loaded in 4-bit NF4 with double quantization and fp32 storage, plus LoRA on
    every linear: the fp32-preserving setup (docs/architecture.md), on CPU."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.util import builtin as tiny

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny.model_dir(), quantization_config=bnb, dtype=torch.float32)
    from finetune.train import lean

    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    lean.apply(model)  # training puts these in at setup (finetune.train.loss.setup_forward)
    return model


def _quant_state_tensors(qs) -> list:
    out = [qs.absmax, qs.code]
    if getattr(qs, "nested", False):
        out += [qs.state2.absmax, qs.offset]
    return [t for t in out if t is not None]


def measure_weights(model) -> dict[str, int]:
    import bitsandbytes as bnb

    got = {"base_4bit": 0, "quant_constants": 0, "unquantized": 0, "lora": 0}
    for _, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if isinstance(p, bnb.nn.Params4bit):
            got["base_4bit"] += nbytes
            got["quant_constants"] += sum(t.numel() * t.element_size() for t in _quant_state_tensors(p.quant_state))
        elif p.requires_grad:
            got["lora"] += nbytes
        else:
            got["unquantized"] += nbytes
    return got


class SavedTensorMeter:
    """Sums the bytes autograd saves for backward, each storage once, parameters excluded."""

    def __init__(self, model):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def _pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @contextlib.contextmanager
    def __call__(self):
        import torch

        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _set_checkpointing(model, on: bool | int):
    """True: every layer; False: none; an int: the first that many (finetune.train.lora.checkpoint_first)."""
    # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    if on:
        kw = {"use_reentrant": False}
        try:
            enable(activation_checkpointing_kwargs=kw)
        except TypeError:  # transformers 4
            enable(gradient_checkpointing_kwargs=kw)
        if on is not True:
            from finetune.train.lora import checkpoint_first

            checkpoint_first(model, on)
    else:
        disable()


def measure_activations(model, batch: int, seq: int, checkpointing: bool | int) -> dict[str, int]:
    """Saved bytes of one forward pass; `per_layer` is the largest decoder layer's own share."""
    import torch

    from finetune.train.loss import attention_kernels

    model.train()
    _set_checkpointing(model, checkpointing)
    meter = SavedTensorMeter(model)
    per_layer, handles = [], []
    layers = model.get_base_model().model.layers
    for layer in layers:  # bytes first saved while each layer runs (shared tables were seen before)
        handles.append(layer.register_forward_pre_hook(lambda *a: per_layer.append(-meter.total)))
        handles.append(layer.register_forward_hook(lambda *a: per_layer.__setitem__(-1, per_layer[-1] + meter.total)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    try:
        # the attention kernels the training loop picks for this batch (finetune.plan.attention)
        with meter(), torch.autocast("cpu", dtype=torch.bfloat16), attention_kernels("cpu", "bf16", seq):
            out = model(input_ids=ids, labels=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    del out
    return {"total": meter.total, "per_layer": max(per_layer) if per_layer else 0}


def measure_training_state(model, batch: int = 2, seq: int = 32) -> dict[str, int]:
    """Gradient and optimizer-state bytes after one step of bitsandbytes' 8-bit AdamW."""
    import bitsandbytes as bnb
    import torch

    _set_checkpointing(model, False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = bnb.optim.AdamW8bit(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    opt.step()
    eight = thirty_two = 0
    for p in params:
        st = opt.state[p]
        # qmap1/qmap2 are one code table shared by every tensor, not per-tensor state.
        nbytes = sum(v.numel() * v.element_size() for k, v in st.items()
                     if isinstance(v, torch.Tensor) and k not in ("qmap1", "qmap2", "step"))
        if st["state1"].dtype == torch.uint8:
            eight += nbytes
        else:
            thirty_two += nbytes
    opt.zero_grad(set_to_none=True)
    return {"gradients": grads, "optimizer_8bit": eight, "optimizer_32bit": thirty_two}


def planned(model, r: int, dropout: float, batch: int = 1, seq: int = 32, checkpointing: bool | int = False) -> E.Plan:
    arch = from_config(model.config.to_dict(), "builtin:tiny-llama")
    s = E.Setup(model="builtin:tiny-llama", seq_len=seq, micro_batch=batch, lora_r=r, lora_dropout=dropout,
                lora_dtype="float32", model_dtype="float32", quant_storage="float32", optimizer="adamw_8bit",
                checkpointing=checkpointing, device="cpu", loss="transformers")  # measured: model(labels=...)
    return E.build(s, arch, "model config")


def rel(planned_bytes: int, measured_bytes: int) -> float:
    return abs(planned_bytes - measured_bytes) / max(1, measured_bytes)


# seq x micro-batch x checkpointing; on CPU in bf16, 32 and 128 tokens take SDPA's math kernel, 256 its flash kernel;
# and the first 2 of the 4 layers checkpointed (model.gradient_checkpointing: 2) on each kernel
SWEEP = list(itertools.product((32, 128, 256), (1, 4), (False, True))) + [(128, 4, 2), (256, 4, 2)]


def compare(r: int = 16, dropout: float = 0.05, sweep=SWEEP) -> list[dict]:
    """One row per measured quantity: name, planned, measured, relative error."""
    model = build_model(r, dropout)
    rows = []
    w = measure_weights(model)
    plan = planned(model, r, dropout)
    for k, v in w.items():
        rows.append({"what": k, "planned": plan.breakdown[k], "measured": v})
    st = measure_training_state(model)
    for k, v in st.items():
        rows.append({"what": k, "planned": plan.breakdown[k], "measured": v})
    per_layer = {}
    for seq, batch, ck in sorted(sweep, key=lambda x: x[2]):  # no-checkpointing runs first: they give per_layer
        got = measure_activations(model, batch, seq, ck)
        p = planned(model, r, dropout, batch, seq, ck)
        terms = E.activation_terms(p.arch, p.setup)
        # saved tensors only: a layer's backward working set (`_transient`) is no saved tensor
        saved = terms["activations"] - terms["_transient"] + terms["_head_saved"]
        if not ck:
            per_layer[(seq, batch)] = got["per_layer"]
            rows.append({"what": f"activations seq={seq} batch={batch} checkpointing=off",
                         "planned": saved, "measured": got["total"]})
        elif ck is not True:
            # the first ck layers checkpointed: the peak is the end of the forward, the later layers' saved
            # tensors on top of the held inputs (a recompute comes after they are freed: plan.activations)
            rows.append({"what": f"activations seq={seq} batch={batch} checkpointing={ck} of {p.arch.layers}",
                         "planned": saved, "measured": got["total"]})
        else:
            # peak with checkpointing: what the checkpoints keep + one layer recomputed in backward
            measured = got["total"] + per_layer.get((seq, batch), 0)
            rows.append({"what": f"activations seq={seq} batch={batch} checkpointing=on",
                         "planned": saved, "measured": measured})
    for row in rows:
        row["error"] = rel(row["planned"], row["measured"])
    return rows


def measured_vs_planned(r: int = 16, dropout: float = 0.05) -> dict:
    """For the `estimate_error` benchmark row: worst relative error of weights/state and of activations."""
    rows = compare(r, dropout)
    act = [x["error"] for x in rows if x["what"].startswith("activations")]
    static = [x["error"] for x in rows if not x["what"].startswith("activations")]
    return {"worst_static_error": max(static), "worst_activation_error": max(act),
            "worst_error": max(static + act), "rows": rows}


if __name__ == "__main__":
    for row in compare():
        print(f"{row['what']:<45} planned {row['planned']:>10} measured {row['measured']:>10} "
              f"error {100 * row['error']:5.1f}%")
