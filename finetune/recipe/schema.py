"""The recipe schema: one YAML that describes a whole run, every key typed and checked strictly.

Defaults live here, once, with one docstring per field; no other module repeats them. Reading a file and
applying overrides is `finetune.recipe.read`; the cross-field rules are `finetune.recipe.contract`."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from finetune.recipe.contract import contract_problems


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error, never silently ignored. allow_inf_nan=False: an infinite
    # learning rate, alpha or epoch count (YAML's .inf, or 1e999) is refused here, not found as a NaN adapter.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


LAYERS_MAX = 1024  # decoder layers a model may have (405B has 126): the bound of an integer gradient_checkpointing
SEED_MAX = 2**32 - 1  # seeds go to torch (a C uint64), Python's random and numpy (uint32): the range all accept


DType = Literal["float32", "bfloat16", "float16"]


class ModelSpec(_Section):
    name: str = "builtin:tiny-llama"
    """Base model: a hub id (read from the local HF cache), a local directory (a pre-quantized `*-bnb-4bit`
    checkpoint too: its packed weights load without quantizing), `builtin:tiny-llama` (a small pretrained
    Llama the project builds itself, for CPU runs and tests), or `synthetic:BASE?layers=N&hidden=H&...`:
    BASE's architecture (a name of the built-in table, a cached hub id, a directory or builtin:tiny-llama)
    with the given shapes (options: layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, seed)
    and seeded random bf16 weights, built once into the cache with the tiny tokenizer (vocab >= 384), for
    memory and speed runs without downloads."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the base model."""
    dtype: DType = "float32"
    """Dtype of every frozen non-quantized parameter (embeddings, norms, lm_head) and, by default, of the
    packed 4-bit storage. Set it to the dtype the checkpoint ships in (bfloat16 for Llama 3, Mistral,
    Qwen 2.5: every shipped GPU recipe does): nothing is cast down, since frozen weights never change and
    bf16 weights stored in fp32 preserve nothing while costing 2 bytes more per parameter (2 GiB for Llama 3
    8B's embeddings and head), and the residual stream then runs in bf16 like the compute. Adapters, their
    gradients and optimizer state stay fp32 (`lora.dtype`) and buffers such as RoPE's inv_freq are kept
    fp32 either way. FSDP2 shards per parameter and takes the mix; FSDP1 flattens one dtype per wrapped
    module, so there it needs `lora.dtype` equal to this (or float32 here). float32 (the default for
    `builtin:tiny-llama`, an fp32 checkpoint) is also what fp16 training needs."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel; flash_attention_2 falls back to sdpa (one line says so) without flash-attn or CUDA."""
    gradient_checkpointing: Union[bool, Literal["auto"], int] = True  # an int: 0..LAYERS_MAX (_checkpointing)
    """Recompute decoder layers' activations in backward instead of keeping them: much less activation memory
    for one more forward of each checkpointed layer. true: every layer; false (or 0): none, the fastest where
    activations fit; N: the first N decoder layers; `auto`: the fewest checkpointed layers whose planned step
    peak fits the device (the GPU's memory, or on a CPU run the RAM available, capped by `max_memory_gib`),
    said in one line as `validate` and `estimate` say it. The right setting for a GPU recipe."""
    max_memory_gib: float | None = Field(None, gt=0)
    """Cap (GiB) on one device's memory (a CPU run: a process's RAM) that `gradient_checkpointing: auto` and
    `validate` plan against, below the device's own (room for another job). Null: the device's memory."""
    activation_offloading: bool = False
    """GPU only: move the activations autograd keeps (with checkpointing: each layer's input) to pinned
    CPU memory during the forward pass and copy them back on a side stream ahead of the backward pass
    that needs them. Saves about layers x tokens x hidden x 2 bytes of GPU memory for PCIe traffic;
    `validate` refuses it on a machine without CUDA, where there is no device memory to save."""
    tiled_mlp: Union[bool, int] = False
    """Run each decoder layer's gated MLP over the sequence in chunks of tokens, forward and backward (each
    chunk recomputed there, LoRA included; gradients the untiled ones to rounding): the [tokens x
    intermediate] activations, most of a long sequence's, exist for one chunk at a time. true: chunks of
    `hidden_size` tokens (a chunk's intermediates the size of one MLP weight); N: N tokens. Costs one more
    MLP forward a step. Gated Llama-form MLPs only (MoE refused by name); docs/long_context.md."""
    reentrant_checkpointing: bool = False
    """Use the reentrant checkpoint implementation (old setups). Off: the non-reentrant one works when the checkpointed
    inputs do not require grad (frozen 4-bit base + LoRA) without `enable_input_require_grads`, composes with FSDP2."""
    trust_remote_code: bool = False
    """Allow a model repository to run its own Python code. Off: only architectures transformers ships."""
    allow_pickle: bool = False
    """Allow loading `.bin`/`.pt` (pickle) weights. Off: safetensors only, as pickle can execute code."""

    @field_validator("tiled_mlp")
    @classmethod
    def _chunk_tokens(cls, v):
        if not isinstance(v, bool) and v < 1:
            raise ValueError("a chunk length in tokens (>= 1), true (chunks of hidden_size tokens) or false")
        return v

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, v):
        text = v.strip().lower() if isinstance(v, str) else None  # one message, not one per union member
        number = int(text) if text and text.isdigit() else v
        if not (isinstance(v, bool) or text in ("auto", "true", "false")
                or type(number) is int and 0 <= number <= LAYERS_MAX):
            raise ValueError(f"must be true, false, auto or a number of decoder layers from 0 to {LAYERS_MAX}")
        return v


class QuantizationSpec(_Section):
    mode: Literal["nf4", "fp4", "int8", "none"] = "nf4"
    """How the frozen base is stored: 4-bit NF4 (QLoRA), 4-bit FP4, 8-bit LLM.int8, or none (plain LoRA)."""
    double_quant: bool = True
    """Quantize the 4-bit quantization constants too (saves ~0.37 bits per parameter)."""
    compute_dtype: DType = "bfloat16"
    """Dtype the 4-bit weights are dequantized to for each matmul."""
    quant_storage: DType | Literal["uint8"] | None = None
    """Dtype the packed 4-bit bytes are stored in. Null means `model.dtype`, which FSDP needs: it shards and gathers
    the storage tensor like any parameter, so it must share the other parameters' dtype (FSDP1 cannot flatten uint8)."""


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
    target_parameters: Union[Literal["auto"], list[str]] = "auto"
    """MoE expert weights that get adapters, through peft's `target_parameters`: transformers 5 fuses each
    layer's experts into 3-D parameters (`experts.gate_up_proj`, `experts.down_proj`) that no
    `target_modules` entry reaches. `auto`: every fused expert parameter the model has (none on a dense
    model); a list names them (e.g. [experts.down_proj]); [] leaves the experts frozen. peft adapts such a
    parameter only without dropout, so an MoE model with adapted experts needs `dropout: 0`."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trainable adapter weights; float32 keeps master weights exact under bf16 autocast."""
    init_adapter: str | None = None
    """Start from an existing adapter instead of fresh weights: a PEFT adapter directory such as an earlier
    run's `RUN_DIR/adapter` (e.g. SFT, then DPO from it). Its rank and target modules must be this
    section's: every adapter weight is loaded, nothing is left fresh. With `train.method: dpo` the
    reference policy is this starting adapter. Null: fresh adapters (B = 0, so the model starts as the base)."""
    use_dora: bool = False
    """DoRA (QDoRA on a 4-bit base): each adapted weight is split into a direction (base + B @ A, column
    norms taken of the base as training dequantizes it) and a learned per-output magnitude vector, trained
    in `lora.dtype` like A and B. Costs one dequantized weight and its norm per adapted layer and step."""
    use_rslora: bool = False
    """rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r, so higher ranks keep learning."""
    loraplus_lr_ratio: float | None = Field(None, ge=1)
    """LoRA+: B matrices (and DoRA magnitudes) learn at this multiple of `train.learning_rate`, A at the
    rate itself (peft's LoRA+ grouping; the paper suggests 16). Null: one rate for all."""
    init: Literal["gaussian", "pissa", "olora", "loftq"] = "gaussian"
    """How A and B start. `gaussian`: today's start, A random (peft's default Kaiming-uniform draw) and B
    zero, so training starts from the base exactly (the only one this round trains). `pissa`, `olora` and
    `loftq` start from the base's principal directions / a QR factor / the 4-bit quantization error: they
    need the unquantized weights in memory and rewrite the base, which the streamed 4-bit load never holds;
    `validate` refuses them with the reason."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must name at least one module, or be 'all-linear'")
        return v


DataFormat = Literal["auto", "text", "prompt_completion", "instruction", "messages", "sharegpt", "tokens",
                     "preference"]


class DataSource(_Section):
    path: str
    """A local file (.jsonl/.json/.csv/.parquet) or folder, a hub dataset id (from the local cache),
    `builtin:tiny-instruct` (the synthetic set the project generates), or
    `synthetic:tokens?rows=N&min_len=A&max_len=B&vocab=V&seed=S`: seeded random token ids over the whole
    vocabulary (vocab 0 or absent: the model's; defaults rows 1000, lengths 32-256), every token trained,
    for memory and speed runs of synthetic models whose vocabulary is not the tiny tokenizer's."""
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
    for the builtin ChatML one. It gets each row's `tools`; every assistant turn trains as it renders at
    inference (docs/data.md). {% generation %} markers, if any, pick the trained tokens inside each turn."""
    prompt_template: Literal["auto", "raw", "chat"] = "auto"
    """How `instruction` and `prompt_completion` rows with text fields train. `chat`: the prompt as the user
    turn and the completion as the assistant turn, rendered with the chat template (an instruction's input
    follows it after a blank line): what a chat server sends an -Instruct model. `raw`: the prompt text
    (`instruction` newline `input` newline) continued by the completion, for base models and completion
    APIs. `auto`: `chat` when there is a chat template (the tokenizer's, or `chat_template`), else `raw`.
    `generate` and `eval` prompt the same way."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A broken row (bad JSON, missing field, wrong type, empty text): stop (exit 2) or skip and report."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many training rows after mixing."""
    shuffle_seed: int = Field(0, ge=0, le=SEED_MAX)
    """Seed of the data order (separate from the model seed), 0 to 2^32-1."""


class TrainSpec(_Section):
    method: Literal["sft", "dpo", "orpo"] = "sft"
    """sft: next-token loss on the trained tokens. dpo: Direct Preference Optimization (sigmoid loss) on
    preference rows (`prompt`, `chosen`, `rejected`), against the starting policy as the reference, whose
    log-probs are computed once before the first step and kept in RUN_DIR/reference. orpo: Odds Ratio
    Preference Optimization (no reference): the SFT loss on the chosen answer plus `orpo_lambda` times the
    odds-ratio term. Preference runs score the answer tokens only and do not pack."""
    beta: float = Field(0.1, gt=0)
    """DPO: the inverse temperature of the implicit reward beta x (log pi - log pi_ref)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """DPO: the assumed share of pairs whose preference is flipped (conservative DPO); 0: plain DPO."""
    dpo_sft_weight: float = Field(0.0, ge=0)
    """DPO: the weight of an SFT term added to the DPO loss, the mean NLL of the chosen answers' tokens (RPO,
    Pang et al. 2024; TRL's `loss_type: [sigmoid, sft]` with `loss_weights: [1, w]`). It keeps the chosen
    answers likely while the margin grows, where plain DPO may lower both; 0: plain DPO."""
    orpo_lambda: float = Field(0.1, gt=0)
    """ORPO: the weight of the odds-ratio term beside the SFT loss on the chosen answer."""
    seed: int = Field(42, ge=0, le=SEED_MAX)
    """Seed for adapter init, dropout and everything else random in training, 0 to 2^32-1."""
    micro_batch_size: int = Field(4, ge=1)
    """Rows per forward pass per process."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; overrides `epochs` when set."""
    epochs: float = Field(1.0, gt=0, le=1e6)
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
    """Autocast dtype of the forward pass. Master weights and buffers stay in their stored dtype. Left unset
    on a CPU without native bf16 (no AVX512/AMX), a run computes in fp32 instead (`no`, and
    quantization.compute_dtype float32): bf16 there runs about 10x slower and saves nothing."""
    loss_chunk_tokens: int = Field(0, ge=0)
    """Trained positions per chunk of the output head and cross-entropy: the loss never holds all positions'
    logits (each chunk's in the compute dtype, reduced to an fp32 log-sum-exp, recomputed in backward). 0:
    automatic, one chunk's fp32 logits at most 256 MiB (523 positions of a 128,256-token vocabulary)."""
    router_aux_loss_coef: float | None = Field(None, ge=0)
    """MoE models: weight of the router's load-balancing loss (the family's own auxiliary loss, logged as `aux_loss`)
    in the trained loss. Null: the model config's `router_aux_loss_coef`; 0: off. Refused on a dense model."""
    compile: bool = False
    """Compile each decoder layer with torch.compile (inductor; one graph shared by every layer): fused kernels,
    same losses; step 1 pays the compile (seconds on a GPU, minutes on a small CPU); a layer that cannot compile
    runs eager and says why. 4-bit bases, LoRA, checkpointing, FSDP1/2 (DoRA on a 4-bit base is refused)."""

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
    """`auto`: resume the output dir's newest complete checkpoint if any; false: start fresh (refuses a dir
    with checkpoints); or a checkpoint path."""
    kernels: Literal["none", "liger"] = "none"
    """Fused GPU kernels for the decoder's element-wise modules. `liger`: Liger Kernel's Triton RMSNorm, RoPE and
    SwiGLU (GeGLU for Gemma) on Llama, Mistral, Qwen 2 / 3, Phi-3 and Gemma 2 / 3 (`pip install 'finetune[kernels]'`;
    the loss stays the chunked head); refused without a CUDA GPU and for other families. `none`: transformers'."""


class EvalSpec(_Section):
    max_batches: int | None = Field(None, ge=1)
    """Cap on held-out batches per evaluation (null: all of them)."""
    exact_match_samples: int = Field(50, ge=0)
    """Held-out rows scored by greedy exact match in `finetune eval`: the completion of prompt/completion and
    instruction rows, the last assistant turn of chat rows (prompted with the chat template as training
    rendered it); both sides are stripped of surrounding whitespace, nothing else is normalised."""
    max_new_tokens: int = Field(32, ge=1)
    """Generation length for exact match and `generate`."""


class DistributedSpec(_Section):
    strategy: Literal["auto", "single", "ddp", "fsdp"] = "auto"
    """auto: single for one process, fsdp for several (FSDP2 unless the `fsdp` section says otherwise),
    decided when the recipe is loaded from num_processes, else from the launcher's process count.
    single: one process. ddp: every process holds a full 4-bit replica (models that fit one device).
    fsdp: parameters sharded across processes (see the `fsdp` section)."""
    _from_auto: bool = PrivateAttr(default=False)
    num_processes: int | None = Field(None, ge=1)
    """Total processes (all machines); null: whatever the launcher starts. A mismatch with the
    launcher is an error before weights load."""
    num_machines: int = Field(1, ge=1)
    """Machines taking part."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto picks nccl with CUDA and gloo on CPU."""
    timeout_minutes: float = Field(30, gt=0, le=525_600)
    """How long a collective waits for a rank that stopped answering (without dying) before the job fails.
    A rank that dies is noticed by the launcher within about a second either way."""

    @property
    def from_auto(self) -> bool:
        """The strategy was `auto`, resolved for the process count (so a launcher's own choice is no conflict)."""
        return self._from_auto


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
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"] = "BACKWARD_PRE"
    """FSDP1: when to prefetch the next all-gather in backward."""
    forward_prefetch: bool = False
    """FSDP1: prefetch the next all-gather in forward."""
    use_orig_params: bool = True
    """FSDP1: keep original parameters visible (needed for frozen + trainable mixes like QLoRA)."""
    mixed_precision_param_dtype: DType | None = None
    """Dtype FSDP casts parameters to for compute. Null: no casting (the fp32-preserving setup, with
    autocast doing bf16 compute). Never cast packed 4-bit storage: set it only equal to model.dtype."""


class OutputSpec(_Section):
    dir: str = "runs/tiny_cpu"
    """Run directory (recipe, adapter, checkpoints, metrics); a relative path is from the current directory."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(default_factory=list)
    """Accelerate trackers that receive every metrics.jsonl record (same steps) and, as the run's config, the
    resolved recipe, data stats and memory plan. Each needs its extra: `pip install 'finetune[wandb]'`.
    TensorBoard writes RUN_DIR/tensorboard; W&B and MLflow read their usual environment (WANDB_MODE,
    WANDB_DIR, MLFLOW_TRACKING_URI, ...). A resumed run continues the same tracker runs
    (RUN_DIR/trackers.json)."""
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
