"""The recipe: one YAML that describes a whole run, checked strictly before anything heavy happens.

`load(path, overrides)` returns a validated `Recipe` or raises `RecipeError` carrying *every* problem at
once, each with its dotted path (``lora.r``) and, for misspelt keys, a did-you-mean. Defaults live here,
once, with one docstring per field; no other module repeats them.

This module imports nothing from the rest of the package (it is the leaf everything else depends on).
"""
from __future__ import annotations

import difflib
import os
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class RecipeError(Exception):
    """Bad input (recipe, overrides, data or arguments). The CLI prints `problems` and exits 2."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        super().__init__(head + "; ".join(self.problems))

    def render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        n = len(self.problems)
        lines = [f"error: {where}{n} problem{'s' if n != 1 else ''} in the recipe" if self.source
                 else f"error: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error, never silently ignored.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


DType = Literal["float32", "bfloat16", "float16"]


class ModelSpec(_Section):
    name: str = "builtin:tiny-llama"
    """Base model: a hub id (read from the local HF cache), a local directory, or `builtin:tiny-llama`
    (a small random Llama the project builds itself, for CPU runs and tests)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the base model."""
    dtype: DType = "float32"
    """Dtype of every non-quantized parameter (embeddings, norms, lm_head) and, by default, of the packed
    4-bit storage. float32 is the fp32-preserving setup: FSDP gathers one dtype and never casts the 4-bit
    storage; bf16 compute comes from autocast. bfloat16 halves those bytes but makes the adapters the only
    fp32 tensors (fine for FSDP2, not for FSDP1)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel. flash_attention_2 falls back to sdpa (with a one-line notice) where flash-attn
    or a CUDA GPU is absent."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: much less activation memory for ~30% more compute."""
    reentrant_checkpointing: bool = False
    """Use the reentrant checkpoint implementation. Off by default because the non-reentrant one works
    when the checkpointed inputs do not require grad (frozen 4-bit base + LoRA) without the
    `enable_input_require_grads` hack, and composes with FSDP2; reentrant is kept for old setups."""
    trust_remote_code: bool = False
    """Allow a model repository to run its own Python code. Off: only architectures transformers ships."""
    allow_pickle: bool = False
    """Allow loading `.bin`/`.pt` (pickle) weights. Off: safetensors only, as pickle can execute code."""
    low_cpu_mem_usage: bool = True
    """Load weights one shard at a time instead of materialising a random-init copy first."""


class QuantizationSpec(_Section):
    mode: Literal["nf4", "fp4", "int8", "none"] = "nf4"
    """How the frozen base is stored: 4-bit NF4 (QLoRA), 4-bit FP4, 8-bit LLM.int8, or none (plain LoRA)."""
    double_quant: bool = True
    """Quantize the 4-bit quantization constants too (saves ~0.37 bits per parameter)."""
    compute_dtype: DType = "bfloat16"
    """Dtype the 4-bit weights are dequantized to for each matmul."""
    quant_storage: DType | Literal["uint8"] | None = None
    """Dtype the packed 4-bit bytes are stored in. Null means `model.dtype`, which FSDP needs: it shards
    and gathers the storage tensor like any parameter, so it must share the other parameters' dtype
    (uint8 cannot be flattened by FSDP1 at all)."""


class LoraSpec(_Section):
    r: int = Field(16, ge=1, le=4096)
    """LoRA rank."""
    alpha: float = Field(32, gt=0)
    """LoRA scaling numerator: the update is (alpha / r) * B @ A."""
    dropout: float = Field(0.05, ge=0, lt=1)
    """Dropout on the LoRA input."""
    target_modules: Union[Literal["all-linear"], list[str]] = "all-linear"
    """Which linear layers get adapters: `all-linear` (every linear but the output head) or a list of
    module names such as [q_proj, v_proj]."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trainable adapter weights; float32 keeps master weights exact under bf16 autocast."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must name at least one module, or be 'all-linear'")
        return v


DataFormat = Literal["auto", "text", "prompt_completion", "instruction", "messages", "sharegpt"]


class DataSource(_Section):
    path: str
    """A local file (.jsonl/.json/.csv/.parquet) or folder, a hub dataset id (from the local cache),
    or `builtin:tiny-instruct` (the synthetic set the project generates)."""
    split: str = "train"
    """Split of a hub or builtin dataset."""
    subset: str | None = None
    """Configuration (subset) of a hub dataset, e.g. `main` for gsm8k; null: its default."""
    format: DataFormat = "auto"
    """Row format; `auto` detects it from the fields."""
    weight: float = Field(1.0, gt=0)
    """Relative share of this source when several are mixed: it contributes weight x its rows
    (0.5: a seeded half of them, 2: each row twice), so equal weights keep the sources' natural sizes."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many rows of this source."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Rename fields to the format's names, e.g. {instruction: question, output: answer}."""


class DataSpec(_Section):
    sources: list[DataSource] = Field(default_factory=lambda: [DataSource(path="builtin:tiny-instruct")])
    """Training data; several sources are mixed by weight."""
    eval_sources: list[DataSource] = Field(default_factory=list)
    """Held-out data. Empty: `eval_split` of the training rows is held out instead."""
    eval_split: float = Field(0.05, ge=0, lt=1)
    """Fraction of training rows held out for eval when `eval_sources` is empty."""
    max_seq_len: int = Field(512, ge=8)
    """Longest tokenized example (or packed row)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """What happens to longer examples; either way they are counted and reported."""
    packing: bool = False
    """Pack several examples into each row without padding; attention cannot cross examples
    (position ids restart per example)."""
    train_on_inputs: bool = False
    """Also train on prompt / user tokens. Off: loss only on completions and assistant turns."""
    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own, for `messages`/`sharegpt` data, or `chatml`
    for the builtin ChatML one. A template with {% generation %} markers decides the trained tokens itself."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A broken row (bad JSON, missing field, wrong type, empty text): stop (exit 2) or skip and report."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many training rows after mixing."""
    shuffle_seed: int = 0
    """Seed of the data order (separate from the model seed)."""


class TrainSpec(_Section):
    seed: int = 42
    """Seed for adapter init, dropout and everything else random in training."""
    micro_batch_size: int = Field(4, ge=1)
    """Rows per forward pass per process."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; overrides `epochs` when set."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training data (when `max_steps` is not set)."""
    learning_rate: float = Field(2e-4, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay on the adapter weights."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate shape after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to the peak learning rate."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; null disables clipping."""
    optimizer: Literal["paged_adamw_8bit", "adamw_8bit", "adamw_torch"] = "paged_adamw_8bit"
    """paged_adamw_8bit (bitsandbytes; paging needs CUDA and falls back to plain 8-bit elsewhere),
    adamw_8bit, or torch's AdamW (32-bit state)."""
    adam_beta1: float = Field(0.9, gt=0, lt=1)
    """Adam's decay rate of the gradient running mean."""
    adam_beta2: float = Field(0.999, gt=0, lt=1)
    """Adam's decay rate of the squared-gradient running mean."""
    adam_epsilon: float = Field(1e-8, gt=0)
    """Adam's denominator term, for numerical stability."""
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    """Autocast dtype of the forward pass. Master weights and buffers stay in their stored dtype."""

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v):
        return "no" if v is False else v  # YAML 1.1 reads a bare `no` as false
    log_every: int = Field(10, ge=1)
    """Write a metrics line every this many optimizer steps."""
    eval_every: int | None = Field(None, ge=1)
    """Evaluate held-out loss every this many steps (null: only at the end)."""
    save_every: int | None = Field(None, ge=1)
    """Write checkpoints/step-N every this many steps (null: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many step checkpoints to keep; older ones are deleted after a newer one is complete."""
    resume: Union[Literal["auto"], bool, str] = "auto"
    """`auto`: continue from the newest complete checkpoint in the output dir if there is one;
    false: start fresh (refuses a dir with checkpoints); or a checkpoint path."""


class EvalSpec(_Section):
    max_batches: int | None = Field(None, ge=1)
    """Cap on held-out batches per evaluation (null: all of them)."""
    exact_match_samples: int = Field(50, ge=0)
    """Held-out prompt/completion rows scored by greedy exact match in `finetune eval`."""
    max_new_tokens: int = Field(32, ge=1)
    """Generation length for exact match and `generate`."""


class DistributedSpec(_Section):
    strategy: Literal["single", "ddp", "fsdp"] = "single"
    """single: one process. ddp: every process holds a full 4-bit replica (models that fit one device).
    fsdp: parameters sharded across processes (see the `fsdp` section)."""
    num_processes: int | None = Field(None, ge=1)
    """Total processes (all machines); null: whatever the launcher starts. A mismatch with the
    launcher is an error before weights load."""
    num_machines: int = Field(1, ge=1)
    """Machines taking part."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto picks nccl with CUDA and gloo on CPU."""
    timeout_minutes: float = Field(30, gt=0)
    """How long a collective waits for a rank that stopped answering (without dying) before the job fails.
    A rank that dies is noticed by the launcher within about a second either way."""


class FsdpSpec(_Section):
    version: Literal[1, 2] = 2
    """FSDP2 (per-parameter DTensor sharding; adapters may keep another dtype) or FSDP1 (flat parameters)."""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """FSDP1 sharding strategy; FSDP2 maps FULL_SHARD to reshard_after_forward=true and SHARD_GRAD_OP to false."""
    reshard_after_forward: bool | None = None
    """FSDP2 only: free gathered parameters after forward (null: from `sharding_strategy`)."""
    auto_wrap_policy: Literal["transformer", "size"] = "transformer"
    """Wrap each transformer layer (found from the model) or any module above `min_num_params`."""
    transformer_layer_cls: list[str] | None = None
    """Layer class names to wrap, e.g. [LlamaDecoderLayer]; null: taken from the model (`_no_split_modules`)."""
    min_num_params: int = Field(100_000_000, ge=1)
    """Size threshold for `auto_wrap_policy: size`."""
    cpu_offload: bool = False
    """Keep sharded parameters (and their optimizer state) in CPU RAM between uses."""
    cpu_ram_efficient_loading: bool = True
    """Only rank 0 reads the weights; the others start empty and receive them (FSDP1 needs
    sync_module_states for this)."""
    sync_module_states: bool | None = None
    """FSDP1: broadcast rank 0's weights at wrap time (null: follow cpu_ram_efficient_loading)."""
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"] = "BACKWARD_PRE"
    """FSDP1: when to prefetch the next all-gather in backward."""
    forward_prefetch: bool = False
    """FSDP1: prefetch the next all-gather in forward."""
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = "SHARDED_STATE_DICT"
    """How optimizer state is checkpointed; the adapter is always gathered to full shapes."""
    use_orig_params: bool = True
    """FSDP1: keep original parameters visible (needed for frozen + trainable mixes like QLoRA)."""
    mixed_precision_param_dtype: DType | None = None
    """Dtype FSDP casts parameters to for compute. Null: no casting (the fp32-preserving setup, with
    autocast doing bf16 compute). Never cast packed 4-bit storage: set it only equal to model.dtype."""


class OutputSpec(_Section):
    dir: str = "runs/tiny_cpu"
    """Run directory (recipe, adapter, checkpoints, metrics). Relative paths are taken from the current
    directory."""
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    """Extra Accelerate trackers besides metrics.jsonl."""
    progress_bar: bool = True
    """Show a progress bar on interactive terminals."""


class Recipe(_Section):
    """A whole run. Every section has defaults; a recipe states only what differs."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    lora: LoraSpec = Field(default_factory=LoraSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    distributed: DistributedSpec = Field(default_factory=DistributedSpec)
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)

    @model_validator(mode="after")
    def _contract(self):
        errors = [p.render() for p in contract_problems(self) if p.level == "error"]
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def effective_quant_storage(self) -> str:
        return self.quantization.quant_storage or self.model.dtype

    def to_yaml_dict(self) -> dict:
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------------
# Cross-field contract: settings that are each valid alone but break together.


class Problem(BaseModel):
    level: Literal["error", "warning"]
    path: str
    message: str
    fix: str = ""

    def render(self) -> str:
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.path}: {self.message}.{fix}"


def contract_problems(r: "Recipe") -> list[Problem]:
    """The FSDP + QLoRA contract and other cross-field rules (see DESIGN.md). Pure: no imports, no I/O."""
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
    if d.num_processes and d.num_processes % d.num_machines:
        out.append(Problem(level="error", path="distributed.num_processes",
                           message=f"{d.num_processes} processes do not divide over {d.num_machines} machines",
                           fix="use a multiple of distributed.num_machines"))
    if d.strategy == "single" and d.num_processes not in (None, 1):
        out.append(Problem(level="error", path="distributed.num_processes",
                           message=f"strategy single runs one process, not {d.num_processes}",
                           fix="set distributed.strategy: fsdp or ddp, or num_processes: 1"))
    if f.cpu_offload and t.optimizer != "adamw_torch" and d.strategy == "fsdp":
        out.append(Problem(level="warning", path="fsdp.cpu_offload",
                           message="offloaded parameters keep their optimizer state on CPU; bitsandbytes' 8-bit "
                                   "update then runs on the CPU backend (slow)",
                           fix="keep it, or use train.optimizer: adamw_torch"))
    if t.warmup_steps and t.max_steps and t.warmup_steps >= t.max_steps:
        out.append(Problem(level="error", path="train.warmup_steps",
                           message=f"{t.warmup_steps} warmup steps leave no training in {t.max_steps} max_steps",
                           fix="lower train.warmup_steps"))
    if isinstance(lo.target_modules, list) and any(n in ("lm_head", "embed_tokens") for n in lo.target_modules) \
            and four_bit:
        out.append(Problem(level="warning", path="lora.target_modules",
                           message="adapters on lm_head/embed_tokens are not quantized layers and add much memory",
                           fix="drop them unless you change the vocabulary"))
    out += _precision_problems(r)
    out += _fsdp_option_problems(r)
    return out


def _precision_problems(r: "Recipe") -> list[Problem]:
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
    if m.reentrant_checkpointing and not m.gradient_checkpointing:
        out.append(Problem(level="warning", path="model.reentrant_checkpointing",
                           message="has no effect with model.gradient_checkpointing off",
                           fix="drop it, or turn model.gradient_checkpointing on"))
    if q.mode == "none" and q.double_quant and q.quant_storage is not None:
        out.append(Problem(level="warning", path="quantization.quant_storage",
                           message="no quantization: quant_storage is unused", fix="drop it"))
    return out


def _fsdp_option_problems(r: "Recipe") -> list[Problem]:
    """FSDP options that only one FSDP version (or only FSDP) reads, and other FSDP misfits."""
    out: list[Problem] = []
    f, d, t = r.fsdp, r.distributed, r.train
    defaults = FsdpSpec()
    if f.cpu_offload and d.strategy != "fsdp":
        out.append(Problem(level="error", path="fsdp.cpu_offload",
                           message=f"CPU offload is an FSDP feature; distributed.strategy is {d.strategy}",
                           fix="set distributed.strategy: fsdp, or fsdp.cpu_offload: false"))
    if d.strategy == "single" and d.num_machines > 1:
        out.append(Problem(level="error", path="distributed.num_machines",
                           message=f"strategy single cannot span {d.num_machines} machines",
                           fix="set distributed.strategy: fsdp or ddp"))
    if d.strategy != "fsdp":
        return out
    if f.version == 2:
        fsdp1_only = [("use_orig_params", "FSDP2 always keeps original parameters"),
                      ("backward_prefetch", "FSDP2 prefetches on its own"),
                      ("forward_prefetch", "FSDP2 prefetches on its own"),
                      ("sync_module_states", "FSDP2 broadcasts through cpu_ram_efficient_loading")]
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
    if f.version == 1 and f.cpu_ram_efficient_loading and f.sync_module_states is False:
        out.append(Problem(level="error", path="fsdp.sync_module_states",
                           message="cpu_ram_efficient_loading leaves ranks > 0 empty; without sync_module_states "
                                   "they train on uninitialised weights", fix="set fsdp.sync_module_states: true"))
    if f.sharding_strategy == "HYBRID_SHARD" and d.num_machines == 1:
        out.append(Problem(level="warning", path="fsdp.sharding_strategy",
                           message="HYBRID_SHARD on one machine is FULL_SHARD", fix="use FULL_SHARD"))
    if t.optimizer != "adamw_torch" and f.state_dict_type == "FULL_STATE_DICT":
        # FSDP's full optimizer state dict flattens/unflattens every state to the parameter's shape;
        # bitsandbytes' blockwise states (uint8 moments + absmax per 256 values) do not survive it
        # (LLaMA-Factory #5619, axolotl #2744): checkpoints fail to save or resume.
        out.append(Problem(level="error", path="fsdp.state_dict_type",
                           message=f"{t.optimizer} state cannot be gathered into FSDP's FULL_STATE_DICT",
                           fix="set fsdp.state_dict_type: SHARDED_STATE_DICT, or train.optimizer: adamw_torch"))
    if f.auto_wrap_policy == "size" and f.transformer_layer_cls:
        out.append(Problem(level="warning", path="fsdp.transformer_layer_cls",
                           message="ignored by auto_wrap_policy: size", fix="drop it, or use auto_wrap_policy: transformer"))
    if d.num_processes == 1:
        out.append(Problem(level="warning", path="distributed.num_processes",
                           message="FSDP over one process shards nothing", fix="use 2 or more, or strategy: single"))
    return out


# ---------------------------------------------------------------------------------------------------
# Loading: YAML -> dict -> overrides -> Recipe, with every error at once.


def _suggest(word: str, candidates) -> str:
    match = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _model_at(path: tuple) -> type[BaseModel] | None:
    """The pydantic section class found at a dotted path, to list valid keys for suggestions."""
    cls: Any = Recipe
    for part in path:
        if isinstance(part, int):
            continue
        fld = getattr(cls, "model_fields", {}).get(part)
        if fld is None:
            return None
        ann = fld.annotation
        inner = getattr(ann, "__args__", None)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        elif inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            cls = inner[0]
        else:
            return None
    return cls


def _format_errors(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(x for x in e["loc"] if x not in ("function-after[_contract()]",))
        dotted = ".".join(str(x) for x in loc)
        kind = e["type"]
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1])
            known = list(parent.model_fields) if parent else []
            where = ".".join(str(x) for x in loc[:-1]) or "top level"
            what = "section" if len(loc) == 1 else "key"
            out.append(f"{dotted}: unknown {what}{_suggest(loc[-1], known)}; valid keys in {where}: "
                       f"{', '.join(known)}")
        elif kind == "value_error" and e.get("ctx", {}).get("error") and not loc:
            out.extend(str(e["ctx"]["error"]).splitlines())
        else:
            msg = e["msg"]
            got = e.get("input")
            shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
            out.append(f"{dotted or 'recipe'}: {msg}{shown}")
    # Literal unions report one line per alternative; keep the first per path.
    seen, dedup = set(), []
    for line in out:
        key = line.split(":", 1)[0]
        if key in seen and "unknown" not in line:
            continue
        seen.add(key)
        dedup.append(line)
    return dedup


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError([f"override '{text}': expected key=value, e.g. train.max_steps=5"])
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise RecipeError([f"override '{text}': empty key"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError):  # not YAML (or nested past the parser's limit): a plain string
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    problems = []
    for text in overrides:
        try:
            parts, value = parse_override(text)
        except RecipeError as e:
            problems += e.problems
            continue
        node = data
        for p in parts[:-1]:
            if not isinstance(node.get(p, {}), dict):
                problems.append(f"override '{text}': {p} is not a section")
                break
            node = node.setdefault(p, {})
        else:
            node[parts[-1]] = value
    if problems:
        raise RecipeError(problems, "command line")
    return data


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.exists():
        raise RecipeError([f"no such file: {p}"], str(p))
    if p.is_dir():
        raise RecipeError([f"{p} is a directory, expected a recipe YAML file"], str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError([f"not UTF-8 text (byte {e.start})"], str(p)) from None
    except OSError as e:
        raise RecipeError([f"cannot read: {e.strerror}"], str(p)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError([f"{where}invalid YAML: {reason}"], str(p)) from None
    except RecursionError:  # PyYAML parses recursively: thousands of nested brackets exhaust the stack
        raise RecipeError(["invalid YAML: nested too deeply"], str(p)) from None
    if data is None:
        raise RecipeError(["the file is empty; a recipe needs at least one section, e.g. `model:`"], str(p))
    if not isinstance(data, dict):
        raise RecipeError([f"top level must be a mapping of sections, got {type(data).__name__}"], str(p))
    return data


def from_dict(data: dict, source: str | None = None) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e), source) from None
    except (TypeError, ValueError) as e:  # e.g. non-string keys
        raise RecipeError([str(e)], source) from None


def load(path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe. Raises RecipeError with every problem at once."""
    data = read_yaml(path)
    data = apply_overrides(data, list(overrides or []))
    return from_dict(data, str(path))


def field_docs(cls: type[BaseModel] = Recipe, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field, for the generated recipe reference."""
    rows = []
    for name, fld in cls.model_fields.items():
        ann = fld.annotation
        key = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += field_docs(ann, key + ".")
            continue
        default = fld.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        elif isinstance(default, list):
            default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
        rows.append((key, repr(default) if not isinstance(default, Enum) else default.value,
                     " ".join((fld.description or "").split())))
    return rows
