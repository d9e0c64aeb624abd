"""`train.kernels`: fused Triton kernels from a maintained library in place of the decoder's element-wise modules.

`liger`: Liger Kernel (`pip install 'finetune[kernels]'`) through its public per-family entry points
(`liger_kernel.transformers.apply_liger_kernel_to_<family>(model=...)`): RMSNorm, RoPE and the gated MLP's
activation (SwiGLU, GeGLU for Gemma) fused, on the loaded model's own modules. Its cross-entropy kernels stay
off: the loss is finetune's chunked head (train/loss.py), which never holds a whole batch's logits either.
Patched modules carry an instance `forward`, so the memory-lean swap (train/lean.py) leaves them alone; Liger's
norm keeps its input and its SwiGLU the two projections for backward, the layouts the planner counts for the
lean modules (to be checked on a GPU: the speed stage's kernels arm beside today's peak).

Checked before any weights load (`kernel_problems`, from the preflight): the family must be one Liger patches
and finetune has run under it (FAMILIES), the machine must have a CUDA GPU (Triton compiles GPU kernels: there
is nothing it runs on a CPU), and the package must be installed.
"""
from __future__ import annotations

import importlib.util

from finetune.util.errors import Problem, RecipeError
from finetune.util.log import log

# model_type -> (Liger's entry point suffix, the keyword of its gated-MLP kernel). MoE families are left out:
# their experts are finetune's packed 4-bit module (weights/experts), which Liger's expert kernels would replace.
FAMILIES = {"llama": ("llama", "swiglu"), "mistral": ("mistral", "swiglu"), "qwen2": ("qwen2", "swiglu"),
            "qwen3": ("qwen3", "swiglu"), "phi3": ("phi3", "swiglu"), "gemma2": ("gemma2", "geglu"),
            "gemma3_text": ("gemma3_text", "geglu")}
INSTALL = "pip install 'finetune[kernels]'"


def kernel_problems(kernels: str, model_type: str | None, cuda_devices: int) -> list[Problem]:
    """Why `train.kernels` cannot run here for this model (empty when it can, or when it is `none`)."""
    if kernels == "none":
        return []
    out = []
    if model_type is not None and model_type not in FAMILIES:
        why = ("its MoE experts are finetune's packed 4-bit module, which Liger's expert kernels would replace"
               if model_type in ("mixtral", "qwen3_moe") else "Liger Kernel has no patch for it")
        out.append(Problem(level="error", path="train.kernels",
                           message=f"liger does not apply to {model_type} models: {why} (it applies to "
                                   f"{', '.join(sorted(FAMILIES))})", fix="set train.kernels: none for this model"))
    if not cuda_devices:  # physical: Triton compiles GPU kernels only; a CPU run has nothing for it to run
        out.append(Problem(level="error", path="train.kernels",
                           message="liger's kernels are Triton GPU kernels and this machine has no CUDA GPU",
                           fix="set train.kernels: none on CPU"))
    elif importlib.util.find_spec("liger_kernel") is None:
        out.append(Problem(level="error", path="train.kernels", message="liger needs the liger-kernel package, "
                           "which is not installed", fix=f"{INSTALL}, or set train.kernels: none"))
    return out


def apply_kernels(model, kernels: str) -> int:
    """Patch the unwrapped PreTrainedModel `model` in place; returns how many modules now run a fused kernel
    (RoPE, patched module-wide, is not counted). The preflight refused what cannot run; this refuses again,
    by name, when called without it."""
    if kernels == "none":
        return 0
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # Liger walks the HF model
    model_type = model.config.model_type
    import torch

    bad = kernel_problems(kernels, model_type, torch.cuda.device_count())
    if bad:
        raise RecipeError([p.render() for p in bad])
    import liger_kernel.transformers as liger

    suffix, mlp = FAMILIES[model_type]
    patch = getattr(liger, f"apply_liger_kernel_to_{suffix}")
    before = {id(m) for m in model.modules() if "forward" in vars(m)}
    patch(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model, **{mlp: True})
    n = sum(1 for m in model.modules() if "forward" in vars(m) and id(m) not in before)
    log.info(f"kernels: liger on {model_type} (RoPE, {n} norms and MLPs fused); the loss stays the chunked head")
    return n
