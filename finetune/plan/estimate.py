"""Memory planner: per-device GPU memory and per-machine CPU RAM of a QLoRA run, from shapes alone.

Reads only JSON (a model's config.json, or the built-in table in `archs`), never weights, and imports
neither torch nor transformers, so a 405B plan answers in well under a second.

Every term is counted the way the libraries lay memory out (bitsandbytes' packed 4-bit storage and
blockwise constants, peft's adapter tensors, bitsandbytes' 8-bit optimizer state with its 4096-element
threshold, FSDP's all-gather of one layer plus the next while the root stays gathered). The activation
terms follow what autograd saves for a Llama-style layer with LoRA on bnb 4-bit linears (see
`layer_saved_bytes`); tests/integration/test_estimate_measured.py measures them with saved-tensor hooks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from finetune.plan import loading, router
from finetune.plan.activations import (DTYPE_BYTES, MP_BYTES, activation_terms, dora_workspace_bytes,
                                       embedding_on_cpu, targeted, targeted_experts)
from finetune.plan.archs import Arch, resolve
from finetune.plan.quantized import (expert_weight_bytes, expert_workspace_bytes, experts_4bit, packed_4bit_bytes,
                                     quant_constant_bytes)
from finetune.plan.pinned import fsdp1_start_extra_bytes, fsdp_offload_bytes
from finetune.util.units import GiB, fmt
CUDA_CONTEXT = GiB // 2  # CUDA context, kernels and cuBLAS workspace: not visible to torch's allocator
NCCL_BUFFERS = GiB // 4  # communicator buffers once there is more than one process
FRAGMENTATION = 0.10  # caching-allocator slack on top of what tensors occupy
PROCESS_RAM = 3 * GiB // 2  # resident size of one Python process with torch, CUDA libs and transformers
# ... without CUDA: a CPU run's process holds its tensors in RAM besides this (measured: the tiny recipe's
# process, 2.6M parameters, peaks at 0.50 GiB RSS loading and 0.56 GiB training; RUN_DIR/memory.json)
CPU_PROCESS_RAM, CPU_START_RSS = GiB // 2, 23 * GiB // 100  # ... of which 0.23 GiB right after its imports


def start_offset(start_rss: int | None) -> int:
    """Bytes a CPU process that started at `start_rss` holds beyond the plan's CPU_START_RSS (0 when unknown):
    the libraries' mapped pages differ by machine and page cache, so a run's plan takes its own start."""
    return start_rss - CPU_START_RSS if start_rss else 0
SHARD_FILE = 5 * 10**9  # hub checkpoints are cut in ~5 GB safetensors shards; loading holds one at a time
BNB_MIN_8BIT = 4096  # bitsandbytes keeps 32-bit optimizer state for tensors smaller than this


@dataclass
class Setup:
    """Everything a plan depends on. `from_recipe` fills it from a recipe; CLI flags override fields."""

    model: str = "builtin:tiny-llama"
    gpus: int = 1  # processes (GPUs) in total, over all machines
    machines: int = 1
    gpu_memory: int | None = None
    seq_len: int = 512
    micro_batch: int = 1
    lora_r: int = 16
    lora_targets: object = "all-linear"
    lora_expert_targets: object = "auto"  # lora.target_parameters (MoE experts)
    lora_dtype: str = "float32"
    lora_dropout: float = 0.05
    use_dora: bool = False  # DoRA: a magnitude per output row, saved outputs and a norm workspace
    quant: str = "nf4"
    double_quant: bool = True
    quant_storage: str = "float32"
    model_dtype: str = "float32"
    mixed_precision: str = "bf16"
    optimizer: str = "paged_adamw_8bit"
    strategy: str = "single"
    fsdp_version: int = 2
    sharding: str = "FULL_SHARD"
    reshard_after_forward: bool | None = None
    offload: bool = False
    checkpointing: bool = True
    activation_offload: bool = False  # checkpointed layer inputs in pinned CPU memory (GPU only)
    tiled_mlp: object = False  # model.tiled_mlp: false, true (chunks of hidden_size tokens) or N tokens a chunk
    # the loss path (plan.logits): "chunked" (train.loss), "full" (cross_entropy on all logits at once) or
    # "transformers" (the model's own labels= loss, as the Trainer and TRL ran it)
    loss: str = "chunked"
    lean_modules: bool = True  # finetune.train.lean's norms and MLPs (other stacks: false)
    # bitsandbytes' quant state is not a parameter, so FSDP leaves all of it on every rank (ours); torchao's
    # NF4Tensor (torchtune) shards its scalers with the packed weight and all-gathers them with it
    quant_state_sharded: bool = False
    tables_whole: bool = True  # FSDP leaves frozen embedding/head whole per rank (ours); other stacks shard them
    loss_chunk_tokens: int = 0  # 0: automatic (finetune.plan.logits.chunk_rows)
    attn: str = "sdpa"
    device: str = "cuda"  # "cpu" plans a CPU run (no CUDA context; CPU dropout keeps a full-width mask)
    method: str = "sft"  # train.method; dpo/orpo forward both sides of every pair at once (from_recipe)
    router_aux_loss_coef: float | None = None  # train.router_aux_loss_coef (None: the model config's; plan.router)

    @property
    def world(self) -> int:
        return self.gpus

    @property
    def per_machine(self) -> int:
        return max(1, self.gpus // self.machines)


def from_recipe(recipe) -> Setup:
    m, q, lo, t, d, f = recipe.model, recipe.quantization, recipe.lora, recipe.train, recipe.distributed, recipe.fsdp
    procs = d.num_processes or 1
    # A preference micro-batch of N pairs is one forward of 2N sequences (chosen and rejected together), so
    # activations and the loss path are planned for 2N; DPO's reference forward is a no-grad pass before the
    # first step (train.refpolicy), which keeps no activations and so never exceeds a training step.
    sequences = t.micro_batch_size * (1 if t.method == "sft" else 2)
    return Setup(model=m.name, gpus=procs, machines=d.num_machines, method=t.method,
                 seq_len=recipe.data.max_seq_len, micro_batch=sequences, lora_r=lo.r,
                 lora_targets=lo.target_modules, lora_expert_targets=lo.target_parameters, lora_dtype=lo.dtype,
                 lora_dropout=lo.dropout, use_dora=lo.use_dora, quant=q.mode,
                 double_quant=q.double_quant, quant_storage=recipe.effective_quant_storage(),
                 model_dtype=m.dtype, mixed_precision=t.mixed_precision, optimizer=t.optimizer, strategy=d.strategy,
                 fsdp_version=f.version, sharding=f.sharding_strategy, reshard_after_forward=f.reshard_after_forward,
                 offload=f.cpu_offload and d.strategy == "fsdp",
                 checkpointing=m.gradient_checkpointing,
                 activation_offload=m.activation_offloading, loss_chunk_tokens=t.loss_chunk_tokens,
                 attn=m.attn_implementation, tiled_mlp=m.tiled_mlp, router_aux_loss_coef=t.router_aux_loss_coef)


# ---------------------------------------------------------------------------------------------------
# Weights


def lora_tensor_sizes(arch: Arch, s: Setup) -> list[int]:
    """Element counts of every adapter tensor (A: r x in, B: out x r, DoRA magnitude: out) in the whole model."""
    sizes = []
    for x in targeted(arch, s.lora_targets):
        sizes += [s.lora_r * x.d_in, x.d_out * s.lora_r] * x.count
        if s.use_dora:  # DoRA's magnitude: one value per output row, trained like A and B
            sizes += [x.d_out] * x.count
    for x in targeted_experts(arch, s):  # peft's ParamWrapper: one A [r*E, in] and one B [out, r*E]
        sizes += [s.lora_r * x.count * x.d_in, x.d_out * s.lora_r * x.count]
    return sizes * arch.layers


def weight_terms(arch: Arch, s: Setup) -> dict[str, int]:
    """Whole-model bytes of each weight category (before sharding)."""
    lin = [x.d_in * x.d_out for x in arch.linears() for _ in range(x.count)] * arch.layers
    mb = DTYPE_BYTES[s.model_dtype]
    if s.quant in ("nf4", "fp4"):
        base = sum(packed_4bit_bytes(n, s.quant_storage) for n in lin)
        consts = sum(quant_constant_bytes(n, s.double_quant) for n in lin)
    elif s.quant == "int8":
        base = sum(lin)
        consts = sum(x.d_out * 4 for x in arch.linears() for _ in range(x.count)) * arch.layers  # per-row scale
    else:
        base, consts = sum(lin) * mb, 0
    emb = arch.vocab * arch.hidden * (1 if arch.tied else 2)
    experts, expert_consts = expert_weight_bytes(arch, s)
    return {"base_4bit": base, "quant_constants": consts + expert_consts, "experts": experts,
            "unquantized": (emb + arch.small_params()) * mb,
            "lora": sum(lora_tensor_sizes(arch, s)) * DTYPE_BYTES[s.lora_dtype]}


def adapted_share(arch: Arch, s: Setup) -> dict:
    """Which share of the base's weight elements carries an adapter (the output head and embeddings count
    as base weights that carry none), so an MoE run whose experts stay frozen shows it."""
    linear = sum(x.d_in * x.d_out * x.count for x in targeted(arch, s.lora_targets)) * arch.layers
    experts = sum(x.d_in * x.d_out * x.count for x in targeted_experts(arch, s)) * arch.layers
    all_experts = sum(x.d_in * x.d_out * x.count for x in arch.expert_params()) * arch.layers
    total = arch.params()
    return {"adapted": linear + experts, "total": total, "pct": 100 * (linear + experts) / max(total, 1),
            "expert_adapted": experts, "expert_total": all_experts}


def describe_adapted(arch: Arch, s: Setup) -> str:
    """One line for `validate`: the adapted share, and where the MoE experts stand."""
    a = adapted_share(arch, s)
    line = (f"adapters: LoRA on {a['adapted'] / 1e9:.3g}B of {a['total'] / 1e9:.3g}B base weights "
            f"({a['pct']:.1f}%)")
    if a["expert_total"]:
        names = ", ".join(x.name for x in targeted_experts(arch, s)) or "none"
        packed, consts = expert_weight_bytes(arch, s)
        held = (f"held 4-bit ({s.quant}{', double quant' if s.double_quant else ''}, per expert): "
                f"{(packed + consts) / 2**30:.2f} GiB" if experts_4bit(s)
                else f"held in {s.model_dtype} ({packed / 2**30:.2f} GiB): the base is not 4-bit")
        line += f"; MoE experts {100 * a['expert_adapted'] / a['expert_total']:.0f}% adapted ({names}), {held}"
    return line


def layer_weight_bytes(w: dict) -> int:
    """Whole-model bytes of the frozen decoder-layer weights: the 4-bit linears and any MoE experts."""
    return w["base_4bit"] + w.get("experts", 0)


def optimizer_terms(arch: Arch, s: Setup, shard: int) -> dict[str, int]:
    """AdamW state (two moments). bitsandbytes 8-bit: one byte per moment plus an fp32 absmax per 256
    values, but tensors under 4096 elements keep fp32 moments; torch AdamW keeps them in the param dtype."""
    sizes = lora_tensor_sizes(arch, s)
    if s.strategy == "fsdp" and s.fsdp_version == 1:
        sizes = [sum(sizes) // arch.layers] * arch.layers  # FSDP1: one flat parameter per wrapped layer
    sizes = [-(-n // shard) for n in sizes]
    if s.optimizer == "adamw_torch":
        return {"optimizer_8bit": 0, "optimizer_32bit": sum(sizes) * 2 * DTYPE_BYTES[s.lora_dtype]}
    small = sum(n for n in sizes if n < BNB_MIN_8BIT)
    big = [n for n in sizes if n >= BNB_MIN_8BIT]
    eight = sum(2 * n + 2 * 4 * -(-n // 256) for n in big)
    return {"optimizer_8bit": eight, "optimizer_32bit": small * 2 * 4}


# ---------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    setup: Setup
    arch: Arch
    source: str
    breakdown: dict = field(default_factory=dict)  # GPU bytes per device, by category
    cpu: dict = field(default_factory=dict)  # CPU bytes per machine, by phase
    load_gpu: int = 0  # GPU bytes per device while the base loads (plan/loading.py)
    notes: list = field(default_factory=list)
    overhead: dict = field(default_factory=dict)  # the parts of breakdown["framework_overhead"]

    @property
    def gpu_bytes_per_device(self) -> int:
        """What the device shows in use (nvidia-smi): allocated + allocator slack + context (+ NCCL)."""
        return sum(self.breakdown.values())

    @property
    def allocated(self) -> int:
        """Peak bytes of live tensors: what torch.cuda.max_memory_allocated() reports."""
        return self.gpu_bytes_per_device - self.breakdown.get("framework_overhead", 0)

    @property
    def reserved(self) -> int:
        """Peak bytes the caching allocator holds: torch.cuda.max_memory_reserved()."""
        return self.allocated + self.overhead.get("allocator_slack", 0)

    @property
    def cpu_bytes_peak(self) -> int:
        return max(self.cpu.values())

    def fits(self) -> bool | None:
        g = self.setup.gpu_memory
        return None if g is None or self.setup.device != "cuda" else self.gpu_bytes_per_device <= g

    def to_json(self) -> dict:
        return {"model": self.setup.model, "source": self.source, "gpu_bytes_per_device": self.gpu_bytes_per_device,
                "cpu_bytes_peak": self.cpu_bytes_peak, "cpu_peak_phase": max(self.cpu, key=self.cpu.get),
                "breakdown": dict(self.breakdown), "cpu_bytes": dict(self.cpu), "fits": self.fits(),
                "gpu_bytes_loading": self.load_gpu,
                "gpu_memory": self.setup.gpu_memory, "params": self.arch.params(),
                "gpu_bytes_allocated": self.allocated, "gpu_bytes_reserved": self.reserved,
                "overhead": dict(self.overhead),
                "trainable_params": sum(lora_tensor_sizes(self.arch, self.setup)), "notes": list(self.notes),
                "setup": {k: v for k, v in asdict(self.setup).items()}}


def _shards(s: Setup) -> int:
    if s.strategy != "fsdp" or s.sharding == "NO_SHARD":
        return 1
    return s.per_machine if s.sharding == "HYBRID_SHARD" else s.world


def _fsdp_buffers(arch: Arch, s: Setup, w: dict, shard: int) -> int:
    """Unsharded copies FSDP all-gathers: the current layer and the prefetched next one, and the root
    (embeddings, final norm, lm_head), which stays gathered from forward through backward."""
    if s.strategy != "fsdp" or (shard == 1 and s.fsdp_version == 1):  # FSDP1 alone: NO_SHARD, no copies
        return 0
    consts = w["quant_constants"] if s.quant_state_sharded else 0  # gathered with their weight
    per_layer = (layer_weight_bytes(w) + w["lora"] + consts) // arch.layers
    keep_all = s.reshard_after_forward is False or s.sharding == "SHARD_GRAD_OP"
    layers = arch.layers if keep_all else 2
    grads = 2 * w["lora"] // arch.layers  # unsharded gradients before reduce-scatter
    if loading.tables_whole(s, shard):  # tables whole on every rank (parallel.replicated_modules)
        return layers * per_layer + grads  # FSDP2 gathers into buffers of their own, on one process too
    local = 0 if s.offload else w["unquantized"] // shard  # the local shard is already counted on the GPU
    return layers * per_layer + grads + w["unquantized"] - local


def build(s: Setup, arch: Arch | None = None, source: str = "") -> Plan:
    if arch is None:
        arch, source = resolve(s.model)
    shard = _shards(s)
    w = weight_terms(arch, s)
    p = Plan(setup=s, arch=arch, source=source)
    on_gpu = 0 if s.offload else 1
    bd = p.breakdown
    bd["base_4bit"] = on_gpu * -(-w["base_4bit"] // shard)
    bd["experts"] = on_gpu * -(-w["experts"] // shard)
    # bnb's quant state is not a parameter: every rank holds it all (torchao's NF4 shards it: Setup)
    bd["quant_constants"] = -(-w["quant_constants"] // shard) if s.quant_state_sharded else w["quant_constants"]
    bd["unquantized"] = on_gpu * -(-(w["unquantized"] - embedding_on_cpu(arch, s)) // shard)
    tables = loading.whole_table_bytes(arch, s, DTYPE_BYTES, shard)  # frozen tables whole on every rank
    if tables:
        bd["unquantized"] = on_gpu * (tables + -(-(w["unquantized"] - tables) // shard))
    bd["lora"] = on_gpu * -(-w["lora"] // shard)
    grads = -(-w["lora"] // shard)
    bd["gradients"] = on_gpu * grads * (2 if s.strategy == "ddp" and s.world > 1 else 1)  # DDP buckets
    opt = optimizer_terms(arch, s, shard)
    bd["optimizer_8bit"] = on_gpu * opt["optimizer_8bit"]
    bd["optimizer_32bit"] = on_gpu * opt["optimizer_32bit"]
    act = activation_terms(arch, s)
    bd["activations"] = act["activations"]
    bd["logits_loss"] = act["logits_loss"]
    bd["router_balance"] = router.balance_bytes(arch, s)  # an MoE's balance loss: every layer's router logits
    bd["fsdp_buffers"] = _fsdp_buffers(arch, s, w, shard)
    biggest = max(x.d_in * x.d_out for x in arch.linears())
    bd["dequant_workspace"] = max(biggest * MP_BYTES[s.mixed_precision] if s.quant != "none" else 0,
                                  expert_workspace_bytes(arch, s))
    bd["dora_workspace"] = dora_workspace_bytes(arch, s)
    if s.device == "cuda":
        p.overhead = {"allocator_slack": int(FRAGMENTATION * sum(bd.values())), "cuda_context": CUDA_CONTEXT,
                      "nccl": NCCL_BUFFERS if s.world > 1 else 0}
    bd["framework_overhead"] = sum(p.overhead.values())
    p.cpu = cpu_phases(arch, s, w, opt, grads, bd)
    if s.activation_offload:
        # pinned host copies of every layer input, per process, plus the embedding table kept on the CPU
        p.cpu["training"] += s.per_machine * (act["_offloaded"] + embedding_on_cpu(arch, s))
    if s.device == "cuda":
        held = loading.process_bytes(arch, s, w, shard, DTYPE_BYTES, reader=True)
        p.load_gpu = int(held * (1 + FRAGMENTATION)) + CUDA_CONTEXT + (NCCL_BUFFERS if s.world > 1 else 0)
    _notes(p, w)
    return p


def cpu_phases(arch: Arch, s: Setup, w: dict, opt: dict, grads: int, bd: dict) -> dict[str, int]:
    """Peak CPU RAM per machine in each phase. On a CPU run the RAM is the device too: each process holds
    what the breakdown plans per device (the steps' peak; between steps, what stays: weights, adapter,
    gradients and optimizer state)."""
    procs = s.per_machine
    cpu_run = s.device == "cpu"
    base = procs * (CPU_PROCESS_RAM if cpu_run else PROCESS_RAM)
    shard_bf16 = min(SHARD_FILE, arch.params() * 2)
    # The streaming loader: one reader per machine, one tensor at a time (plan/loading.py).
    phases = {"loading": loading.machine_bytes(arch, s, w, _shards(s), DTYPE_BYTES, base // procs)}
    if cpu_run:
        kept = sum(v for k, v in bd.items() if k not in ("activations", "logits_loss", "router_balance",
                                                           "fsdp_buffers", "dequant_workspace", "dora_workspace"))
        base, steps = base + procs * kept, base + procs * sum(bd.values())
    machine_share = s.per_machine / s.world
    if s.offload:
        # each process: its pinned parameter shards (and FSDP1's pinned gradient for every one of them)
        # plus its optimizer state, which steps on the CPU
        opt_rank = opt["optimizer_8bit"] + opt["optimizer_32bit"]
        units, tensors = _offload_units(arch, s, w)
        pinned = fsdp_offload_bytes(units, tensors, w["lora"], _shards(s), s.fsdp_version)
        if s.fsdp_version == 1:
            # the first forward: pinned copies made, unpinned shards not yet freed, no optimizer state yet
            phases["training_start"] = base + procs * (pinned + fsdp1_start_extra_bytes(units, _shards(s)))
        phases["training"] = base + procs * (pinned + opt_rank)
    else:
        phases["training"] = steps if cpu_run else base
    opt_all = (opt["optimizer_8bit"] + opt["optimizer_32bit"]) * _shards(s)
    phases["saving"] = base + w["lora"] + int(opt_all * machine_share)  # gathered adapter + this machine's state
    # The streaming merge holds one bf16 input shard, its merged copy and the adapter.
    phases["merging"] = PROCESS_RAM + 2 * shard_bf16 + sum(lora_tensor_sizes(arch, s)) * 4
    return phases


def _offload_units(arch: Arch, s: Setup, w: dict) -> tuple[list[int], list[int]]:
    """What fsdp.cpu_offload pins (plan.pinned): the bytes of each wrapped unit (FSDP1 flattens one), and
    of each parameter tensor (FSDP2 shards them one by one)."""
    per_layer = (layer_weight_bytes(w) + w["lora"]) // arch.layers
    units = [per_layer] * arch.layers + [w["unquantized"]]  # decoder layers, then the root
    tensors = [packed_4bit_bytes(x.d_in * x.d_out, s.quant_storage) if s.quant in ("nf4", "fp4")
               else x.d_in * x.d_out * DTYPE_BYTES[s.model_dtype]
               for x in arch.linears() for _ in range(x.count)] * arch.layers
    tensors += [w["experts"] // max(1, arch.layers * len(arch.expert_params()))] * len(arch.expert_params()) * arch.layers
    tensors += [arch.vocab * arch.hidden * DTYPE_BYTES[s.model_dtype]] * (1 if arch.tied else 2)
    return units, tensors


def _notes(p: Plan, w: dict):
    s = p.setup
    if s.offload:
        p.notes.append("fsdp.cpu_offload: sharded weights, gradients and optimizer state live in CPU RAM")
    if "training_start" in p.cpu:
        p.notes.append("FSDP1 pins every shard (and a pinned gradient) before the first forward frees the unpinned "
                       "copy: training_start holds each shard three times")
    if s.method != "sft":
        p.notes.append(f"train.method {s.method}: each micro-batch of pairs runs as {s.micro_batch} sequences "
                       "(chosen and rejected in one forward)"
                       + ("; the reference log-probs are one no-grad pass before the first step" if s.method == "dpo"
                          else ""))
    if s.device == "cuda" and s.attn == "eager":
        p.notes.append("eager attention keeps the seq_len x seq_len probabilities of every head")
    fit = p.fits()
    if fit is False:
        p.notes.append(f"does not fit: {fmt(p.gpu_bytes_per_device)} planned per GPU, {fmt(s.gpu_memory)} available")
