"""The cross-field contract: settings that are each valid alone but break together (the FSDP + QLoRA
contract and friends). Pure functions of a Recipe (no I/O), so the schema can run them at validation time
and `finetune validate` can list them with their fixes.
"""
from __future__ import annotations

from finetune.recipe.lora_methods import lora_method_problems
from finetune.util.errors import Problem


def contract_problems(r) -> list[Problem]:
    """The FSDP + QLoRA contract and other cross-field rules (docs/architecture.md). Pure: no I/O."""
    d = r.distributed
    return (_storage_problems(r) + process_count_problems(d.strategy, d.num_processes, d.num_machines)
            + _training_problems(r) + _precision_problems(r) + _fsdp_option_problems(r)
            + lora_method_problems(r) + _compile_problems(r))


def process_count_problems(strategy: str, processes: int | None, machines: int) -> list[Problem]:
    """The process-count rules, wherever a count is set: the recipe, `accelerate-config --gpus`, a SLURM job."""
    out: list[Problem] = []
    if processes and processes % machines:
        out.append(Problem(level="error", path="distributed.num_processes",
                           message=f"the process count {processes} does not divide over {machines} machines",
                           fix="use a multiple of distributed.num_machines"))
    if strategy == "single" and processes not in (None, 1):
        out.append(Problem(level="error", path="distributed.num_processes",
                           message=f"strategy single runs one process, not {processes}",
                           fix="set distributed.strategy: fsdp or ddp, or num_processes: 1"))
    if strategy == "single" and machines > 1:
        out.append(Problem(level="error", path="distributed.num_machines",
                           message=f"strategy single cannot span {machines} machines",
                           fix="set distributed.strategy: fsdp or ddp"))
    return out


def _storage_problems(r) -> list[Problem]:
    """How FSDP may hold the packed 4-bit storage and the adapters beside it."""
    out: list[Problem] = []
    q, m, lo, f, t, d = r.quantization, r.model, r.lora, r.fsdp, r.train, r.distributed
    storage = q.quant_storage or m.dtype
    four_bit = q.mode in ("nf4", "fp4")
    if four_bit and d.strategy == "fsdp" and storage != m.dtype:
        out.append(Problem(level="error", path="quantization.quant_storage",
                           message=f"{storage} differs from model.dtype {m.dtype}; FSDP shards the packed 4-bit "
                                   "storage with the other parameters and needs one dtype",
                           fix=f"set quantization.quant_storage: {m.dtype} (or null)"))
    if four_bit and d.strategy == "fsdp" and storage == "uint8":
        out.append(Problem(level="error", path="quantization.quant_storage",
                           message="uint8 storage cannot be sharded by FSDP ('Cannot flatten integer dtype tensors')",
                           fix=f"set quantization.quant_storage: {m.dtype}"))
    if d.strategy == "fsdp" and f.mixed_precision_param_dtype not in (None, m.dtype) and four_bit:
        out.append(Problem(level="error", path="fsdp.mixed_precision_param_dtype",
                           message=f"FSDP would cast the packed 4-bit storage ({storage}) to "
                                   f"{f.mixed_precision_param_dtype}, which corrupts it",
                           fix=f"set it to null (autocast does bf16 compute) or to {m.dtype}"))
    if d.strategy == "fsdp" and f.version == 1 and lo.dtype != m.dtype and q.mode != "int8":
        out.append(Problem(level="error", path="lora.dtype",
                           message=f"FSDP1 flattens each wrapped module into one tensor of one dtype; adapters "
                                   f"in {lo.dtype} and base in {m.dtype} fail with 'Must flatten tensors with uniform dtype'",
                           fix=f"set lora.dtype: {m.dtype}, or use fsdp.version: 2"))
    if d.strategy == "fsdp" and f.version == 1 and not f.use_orig_params:
        out.append(Problem(level="error", path="fsdp.use_orig_params",
                           message="FSDP1 with frozen and trainable parameters in one wrapped module needs "
                                   "use_orig_params",
                           fix="set fsdp.use_orig_params: true"))
    if d.strategy == "fsdp" and q.mode == "int8":
        out.append(Problem(level="error", path="quantization.mode",
                           message="int8 (LLM.int8) weights cannot be sharded by FSDP",
                           fix="use quantization.mode: nf4, or distributed.strategy: ddp"))
    if t.mixed_precision == "fp16" and four_bit and storage == "bfloat16":
        out.append(Problem(level="error", path="train.mixed_precision",
                           message="fp16 autocast with bf16 storage mixes two half types",
                           fix="use train.mixed_precision: bf16, or model.dtype: float32"))
    if m.reentrant_checkpointing and d.strategy == "fsdp" and f.version == 2:
        out.append(Problem(level="warning", path="model.reentrant_checkpointing",
                           message="reentrant checkpointing under FSDP2 re-gathers parameters twice and needs "
                                   "input grads enabled", fix="set model.reentrant_checkpointing: false"))
    return out


def _training_problems(r) -> list[Problem]:
    out: list[Problem] = []
    q, lo, f, t, d = r.quantization, r.lora, r.fsdp, r.train, r.distributed
    four_bit = q.mode in ("nf4", "fp4")
    if f.cpu_offload and t.optimizer != "adamw_torch" and d.strategy == "fsdp":
        out.append(Problem(level="warning", path="fsdp.cpu_offload",
                           message="offloaded parameters keep their optimizer state on CPU; bitsandbytes' 8-bit "
                                   "update then runs on the CPU backend (slow)",
                           fix="keep it, or use train.optimizer: adamw_torch"))
    if t.warmup_steps and t.max_steps and t.warmup_steps >= t.max_steps:
        out.append(Problem(level="error", path="train.warmup_steps",
                           message=f"{t.warmup_steps} warmup steps leave no training in {t.max_steps} max_steps",
                           fix="lower train.warmup_steps"))
    if t.method != "sft" and r.data.packing:
        out.append(Problem(level="error", path="data.packing",
                           message=f"train.method {t.method} scores each answer as one sequence; packing mixes them",
                           fix="set data.packing: false"))
    if isinstance(lo.target_modules, list) and any(n in ("lm_head", "embed_tokens") for n in lo.target_modules) \
            and four_bit:
        out.append(Problem(level="warning", path="lora.target_modules",
                           message="adapters on lm_head/embed_tokens are not quantized layers and add much memory",
                           fix="drop them unless you change the vocabulary"))
    return out


def _precision_problems(r) -> list[Problem]:
    out: list[Problem] = []
    q, m, lo, t, d = r.quantization, r.model, r.lora, r.train, r.distributed
    four_bit = q.mode in ("nf4", "fp4")
    if t.mixed_precision == "fp16" and m.dtype != "float32":
        # fp16 has 5 exponent bits: weights and updates kept in fp16 underflow; the loss scaler needs fp32
        # master weights (fsdp_qlora: "fp16 only works with autocast").
        out.append(Problem(level="error", path="model.dtype",
                           message=f"fp16 training needs fp32 storage and master weights, not {m.dtype}",
                           fix="set model.dtype: float32 (fp16 autocast computes in half precision anyway)"))
    if t.mixed_precision == "fp16" and lo.dtype != "float32":
        out.append(Problem(level="error", path="lora.dtype",
                           message=f"fp16 autocast with {lo.dtype} adapters: gradient scaling needs fp32 adapter "
                                   "weights", fix="set lora.dtype: float32"))
    if four_bit and t.mixed_precision in ("bf16", "fp16"):
        want = {"bf16": "bfloat16", "fp16": "float16"}[t.mixed_precision]
        if q.compute_dtype != want:
            out.append(Problem(level="warning", path="quantization.compute_dtype",
                               message=f"4-bit layers dequantize to {q.compute_dtype} while autocast computes in "
                                       f"{want}: every layer converts back and forth", fix=f"set it to {want}"))
    if four_bit and d.strategy != "fsdp" and q.quant_storage not in (None, "uint8", m.dtype):
        out.append(Problem(level="warning", path="quantization.quant_storage",
                           message=f"{q.quant_storage} storage only matters for FSDP; without it, it just differs "
                                   f"from model.dtype {m.dtype}", fix="leave quantization.quant_storage null"))
    if m.activation_offloading and m.gradient_checkpointing is not True:
        # a layer that is not checkpointed keeps all its activations, and the offload hooks would move them all
        out.append(Problem(level="error", path="model.activation_offloading",
                           message="offloads the layer inputs that gradient checkpointing keeps; a layer not "
                                   "checkpointed (false, auto or a count) would send every activation across PCIe "
                                   "twice per step",
                           fix="set model.gradient_checkpointing: true, or activation_offloading: false"))
    if m.reentrant_checkpointing and not m.gradient_checkpointing:
        out.append(Problem(level="warning", path="model.reentrant_checkpointing",
                           message="has no effect with model.gradient_checkpointing off",
                           fix="drop it, or turn model.gradient_checkpointing on"))
    if q.mode == "none" and q.double_quant and q.quant_storage is not None:
        out.append(Problem(level="warning", path="quantization.quant_storage",
                           message="no quantization: quant_storage is unused", fix="drop it"))
    return out


def _fsdp_option_problems(r) -> list[Problem]:
    """FSDP options that only one FSDP version (or only FSDP) reads, and other FSDP misfits."""
    out: list[Problem] = []
    f, d = r.fsdp, r.distributed
    defaults = type(f)()  # the schema defaults, without importing the schema
    if f.cpu_offload and d.strategy != "fsdp":
        out.append(Problem(level="error", path="fsdp.cpu_offload",
                           message=f"CPU offload is an FSDP feature; distributed.strategy is {d.strategy}",
                           fix="set distributed.strategy: fsdp, or fsdp.cpu_offload: false"))
    if d.strategy != "fsdp":
        return out
    if f.version == 2:
        fsdp1_only = [("use_orig_params", "FSDP2 always keeps original parameters"),
                      ("backward_prefetch", "FSDP2 prefetches on its own"),
                      ("forward_prefetch", "FSDP2 prefetches on its own")]
        for name, why in fsdp1_only:
            if getattr(f, name) != getattr(defaults, name):
                out.append(Problem(level="warning", path=f"fsdp.{name}", message=f"only FSDP1 reads it; {why}",
                                   fix=f"drop fsdp.{name}, or set fsdp.version: 1"))
        if f.reshard_after_forward is not None and f.sharding_strategy != defaults.sharding_strategy:
            out.append(Problem(level="warning", path="fsdp.reshard_after_forward",
                               message="both reshard_after_forward and sharding_strategy are set; "
                                       "reshard_after_forward wins", fix="set only one"))
    elif f.reshard_after_forward is not None:
        out.append(Problem(level="warning", path="fsdp.reshard_after_forward",
                           message="only FSDP2 reads it; FSDP1 uses sharding_strategy",
                           fix="use fsdp.sharding_strategy (SHARD_GRAD_OP keeps parameters after forward)"))
    if f.sharding_strategy == "HYBRID_SHARD" and d.num_machines == 1:
        out.append(Problem(level="warning", path="fsdp.sharding_strategy",
                           message="HYBRID_SHARD on one machine is FULL_SHARD", fix="use FULL_SHARD"))
    if f.auto_wrap_policy == "size" and f.transformer_layer_cls:
        out.append(Problem(level="warning", path="fsdp.transformer_layer_cls",
                           message="ignored by auto_wrap_policy: size", fix="drop it, or use auto_wrap_policy: transformer"))
    if d.num_processes == 1:
        out.append(Problem(level="warning", path="distributed.num_processes",
                           message="FSDP over one process runs the sharded load and wrap on one shard (saves no "
                           "memory; a check of the FSDP path on one GPU)",
                           fix="use 2 or more to shard, or strategy: single to train one process plainly"))
    return out




def _compile_problems(r) -> list[Problem]:
    """What `train.compile` cannot compile (finetune.train.compiled), refused before anything loads."""
    q, lo = r.quantization, r.lora
    if r.train.compile and lo.use_dora and q.mode in ("nf4", "fp4"):
        # Measured (torch 2.13, peft 0.21.2): dynamo stops at "Unsupported tensor subclass overridden attribute
        # access" in every layer, so every layer would fall back to eager.
        return [Problem(level="error", path="train.compile",
                        message="peft's DoRA reads the 4-bit weight's quantization state from bitsandbytes' "
                                "Params4bit (an attribute of a tensor subclass torch.compile cannot trace): no "
                                "decoder layer would compile", fix="set train.compile: false, or lora.use_dora: false")]
    return []
