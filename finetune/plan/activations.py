"""Activation terms of the memory plan: what autograd saves for a Llama-style layer with LoRA on bnb 4-bit
linears (tests/integration/test_estimate_measured.py measures them with saved-tensor hooks), what
checkpointing holds across layers, and the loss path at the output head (finetune.plan.logits).

The peak is planned phase by phase rather than as one sum: the loss (end of the forward and start of the
backward) and the backward of the recomputed layer never hold their working sets at the same time, and
each adds to what checkpointing holds for every layer.
"""
from __future__ import annotations

from finetune.plan.archs import Arch
from finetune.plan.attention import uses_cpu_math_kernel
from finetune.plan.logits import chunked_loss_bytes, full_logits_bytes, transformers_loss_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}
MP_BYTES = {"bf16": 2, "fp16": 2, "no": 4}
LEAN_TYPES = {"llama", "mistral", "qwen2"}  # model types whose norms and MLPs finetune.train.lean replaces
# Qwen3's q/k norms (Llama-style RMSNorm per head; Gemma 3's differ and are not planned here)
QK_RMSNORM = {"qwen3", "qwen3_moe"}
PREFETCHED_LAYERS = 2  # activation offloading: the layer input being used and the one copied in ahead


def targeted(arch: Arch, targets) -> list:
    if targets == "all-linear":
        return arch.linears()
    wanted = set(targets)
    return [x for x in arch.linears() if x.name in wanted]


RESIDUAL_WRITERS = {"o_proj", "down_proj", "dense", "dense_4h_to_h"}  # linears whose output joins the residual
MLP_INPUTS = {"gate_proj", "up_proj", "gate_up_proj", "dense_h_to_4h"}


def dora_promotes(arch: Arch, s, names: set) -> bool:
    """Whether a DoRA adapter on one of `names` hands back fp32. On CUDA peft runs DoRA under autocast
    without casting back: its magnitude scale (lora.dtype float32) times the base output (bf16) promotes, so
    the layer's output is fp32 and so is whatever adds it (measured on an H100: 4-layer 8B widths at 2 x 2048,
    DoRA steps 6.01 GiB where the bf16 plan said 5.17; benchmarks/RESULTS_GPU.md). On CPU peft casts the
    adapter's sum back to the input's dtype."""
    return (getattr(s, "use_dora", False) and s.device == "cuda"
            and DTYPE_BYTES[s.lora_dtype] > MP_BYTES[s.mixed_precision]
            and bool(names & {x.name for x in targeted(arch, s.lora_targets)}))


def residual_bytes(arch: Arch, s) -> int:
    """Bytes per element of the residual stream between layers: the model dtype, or fp32 once a promoting
    DoRA output (o_proj, down_proj) is added to it."""
    return 4 if dora_promotes(arch, s, RESIDUAL_WRITERS) else DTYPE_BYTES[s.model_dtype]


def targeted_experts(arch: Arch, s) -> list:
    """The fused expert parameters that carry adapters (lora.target_parameters)."""
    wanted = getattr(s, "lora_expert_targets", "auto")
    params = arch.expert_params()
    if wanted == "auto":
        return params
    return [x for x in params if x.name in set(wanted) or x.name.split(".")[-1] in set(wanted)]


def lora_linear_saved(tokens: int, d_in: int, d_out: int, r: int, s) -> int:
    """Saved for backward by one LoRA-wrapped 4-bit linear. The frozen 4-bit matmul keeps only the weight;
    the adapter path keeps the dropout mask, the compute-dtype input of A, the input of B and the
    autocast copies of A and B."""
    cb = MP_BYTES[s.mixed_precision]
    total = tokens * d_in * cb + tokens * r * cb
    if s.lora_dropout > 0:
        # CUDA's fused dropout keeps a bool mask; CPU keeps a mask of the (adapter-cast) input's dtype.
        # (peft casts the input to the adapter dtype first when it sees no CUDA autocast, as on CPU).
        total += tokens * d_in * (1 if s.device == "cuda" else DTYPE_BYTES[s.lora_dtype])
    if DTYPE_BYTES[s.lora_dtype] != cb:
        total += r * (d_in + d_out) * cb
    if getattr(s, "use_dora", False):
        # peft's DoRA output is (m / ||W + sBA|| - 1) * base_out + (m / ||.||) * s * lora_out: the magnitude's
        # gradient keeps both outputs (the norm itself is detached, so nothing of W is kept).
        total += 2 * tokens * d_out * cb
    return total


def dora_workspace_bytes(arch: Arch, s) -> int:
    """The transient of one DoRA layer's forward, largest adapted linear: peft builds B @ A by pushing an
    identity [in, in] (adapter dtype) through A and B, then takes the column norms of the dequantized weight
    plus that update (adapter-dtype product, its compute-dtype copy, the dequantized weight and the sum)."""
    if not getattr(s, "use_dora", False):
        return 0
    lb, cb = DTYPE_BYTES[s.lora_dtype], MP_BYTES[s.mixed_precision]
    return max((x.d_in * x.d_in * lb + x.d_in * x.d_out * (lb + 3 * cb) for x in targeted(arch, s.lora_targets)),
               default=0)


MLP_LINEARS = {"gate_proj", "up_proj", "down_proj"}  # the gated MLP model.tiled_mlp runs in chunks


def tile_tokens(arch: Arch, s) -> int:
    """model.tiled_mlp as tokens per chunk (0: off); true is hidden_size tokens (finetune.train.tiled)."""
    tiled = getattr(s, "tiled_mlp", False)
    if tiled is False or arch.experts or not arch.gated_mlp():
        return 0
    return arch.hidden if tiled is True else int(tiled)


def tiled(arch: Arch, s, t: int) -> bool:
    """Whether a forward of `t` tokens runs its MLPs in chunks (one chunk's worth runs them whole)."""
    return 0 < tile_tokens(arch, s) < t


def mlp_saved_bytes(arch: Arch, s, t: int) -> int:
    """What a gated MLP's adapters and intermediates keep for `t` tokens (no MoE): the LoRA inputs of gate,
    up and down (gate's and up's one tensor where they share it, see shared_lora_inputs), the activation's
    input and output and up's output (the lean MLP recomputes the activation's output)."""
    cb = MP_BYTES[s.mixed_precision]
    names = {x.name for x in targeted(arch, s.lora_targets)} & MLP_LINEARS
    total = sum(lora_linear_saved(t, x.d_in, x.d_out, s.lora_r, s) for x in arch.linears() if x.name in names)
    if s.device == "cuda" and s.lora_dropout == 0 and DTYPE_BYTES[s.model_dtype] == cb:
        total -= max(0, len(names & {"gate_proj", "up_proj"}) - 1) * t * arch.hidden * cb
    return total + t * arch.intermediate * mlp_bytes(arch, s) * (2 if lean(arch, s) else 3)


def mlp_chunk_bytes(arch: Arch, s) -> int:
    """The tiled MLP's working set in backward: one chunk's adapters and intermediates, recomputed, for one
    layer at a time (0 when model.tiled_mlp is off or the sequence is one chunk)."""
    t = s.micro_batch * s.seq_len
    return mlp_saved_bytes(arch, s, min(t, tile_tokens(arch, s))) if tiled(arch, s, t) else 0


def backward_transient_bytes(arch: Arch, s) -> int:
    """One layer's backward working set beyond what it saved: the larger of its attention's and its MLP's,
    which run one after the other. The gated MLP's backward holds, beside its kept gate and up outputs, the
    gradient arriving from down_proj, the recomputed activation output and product (the lean MLP), and the
    gradients of up, of the activation and of gate: six [tokens x intermediate] tensors (four for HF's MLP,
    which keeps its activation's output; two ungated), per chunk when tiled. Measured: the untiled arm of
    benchmarks/cpu/long_context.py peaked 0.66 GiB above the plan without it. Attention's holds the output's
    gradient and those of q, k and v (and of the [T x T] probabilities where the kernel keeps them).
    MoE experts see routed tokens and are planned by experts_saved_bytes alone.
    Counted on CPU only, where it is measured: the GPU runs on record (benchmarks/RESULTS_GPU.md, 8B widths at
    2 x 2048 on an H100) peaked 0.12-0.19 GiB above the plan without it, where it would add 0.66 GiB; what
    CUDA's backward keeps beyond the saved tensors needs a GPU measurement (docs/long_context.md)."""
    if s.device == "cuda":
        return 0
    t = s.micro_batch * s.seq_len
    cb = MP_BYTES[s.mixed_precision]
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    attn = t * (2 * q + 2 * kv) * cb
    if s.attn == "eager" or (s.attn == "sdpa" and uses_cpu_math_kernel(s.device, s.mixed_precision, s.seq_len)):
        attn += s.micro_batch * arch.heads * s.seq_len * s.seq_len * 4
    if arch.experts:
        return attn
    n = (6 if lean(arch, s) else 4) if arch.gated_mlp() else 2
    mlp_t = min(t, tile_tokens(arch, s)) if tiled(arch, s, t) else t
    return max(attn, n * mlp_t * arch.intermediate * mlp_bytes(arch, s))


def shared_lora_inputs(arch: Arch, s, t: int, names: set) -> int:
    """Adapter inputs counted above that are one tensor in fact. On CUDA, without dropout and with the
    residual stream already in the compute dtype, every adapter's A keeps the very tensor its layer's
    input is: q/k/v (and gate/up) share one norm output, which is then kept once. (With dropout, each
    adapter keeps its own dropped copy; with a wider residual, autocast makes a copy per matmul.)"""
    cb = MP_BYTES[s.mixed_precision]
    if s.device != "cuda" or s.lora_dropout > 0 or DTYPE_BYTES[s.model_dtype] != cb or arch.experts:
        return 0
    groups = [{"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}]
    return sum(max(0, len(g & names) - 1) for g in groups) * t * arch.hidden * cb


def experts_saved_bytes(arch: Arch, s, t: int) -> int:
    """MoE experts held in the model dtype: each routed token's input to each expert matmul, and, for an adapted fused parameter,
    the adapted weight W + scale * B @ A that peft's parametrization builds (model dtype, all experts),
    which every expert's matmul keeps for backward."""
    cb, mb = MP_BYTES[s.mixed_precision], DTYPE_BYTES[s.model_dtype]
    adapted = {x.name for x in targeted_experts(arch, s)}
    if s.quant in ("nf4", "fp4"):
        # 4-bit experts (weights/experts/module.py), per routed token: its (token, slot) index pair (int64), the
        # down projection's output and routing weight (the weighting multiply keeps both), and the weighted
        # output cast to the residual stream's dtype (index_add_ keeps its source). The frozen matmul keeps
        # nothing (it dequantizes again in backward); an adapted one keeps its routed input to A and B's
        # input, and each expert's slice of A and B cast to the compute dtype. Measured on the synthetic
        # Qwen3-MoE and Mixtral (tests/integration/test_moe_4bit.py).
        routed = t * arch.experts_per_tok
        total = routed * (16 + arch.hidden * cb + cb + arch.hidden * mb)
        return total + sum(routed * (x.d_in + s.lora_r) * cb + s.lora_r * x.count * (x.d_in + x.d_out) * cb
                           for x in arch.expert_params() if x.name in adapted)
    total = 0
    for x in arch.expert_params():
        total += t * arch.experts_per_tok * x.d_in * cb
        if x.name in adapted:
            total += x.d_in * x.d_out * x.count * mb
    return total


def lean(arch: Arch, s) -> bool:
    """Whether finetune.train.lean's norms and MLPs run (Setup.lean_modules, Llama-style models)."""
    return s.lean_modules and arch.model_type in LEAN_TYPES


def mlp_bytes(arch: Arch, s) -> int:
    """Bytes per element of the MLP's intermediate activations. On CUDA, autocast runs peft's adapter in
    the compute dtype, so base + adapter outputs stay half precision (fp32 when a DoRA adapter promotes
    them); on CPU peft computes the adapter in its own dtype (no CUDA autocast) and the sum is promoted to
    the stored dtype."""
    if s.device != "cuda":
        return DTYPE_BYTES[s.model_dtype]
    return 4 if dora_promotes(arch, s, MLP_INPUTS) else MP_BYTES[s.mixed_precision]


def checkpointed_layers(arch: Arch, s) -> int:
    """How many decoder layers `Setup.checkpointing` recomputes: True all, False none, an int the first N
    (at most all). `auto` unresolved (no memory to plan against: plan.checkpointing.fit) plans all."""
    c = s.checkpointing
    if c is True or c == "auto":
        return arch.layers
    return min(int(c), arch.layers)


def checkpointing_words(arch: Arch, s) -> str:
    """`on`, `off` or `N of L layers`: the plan's header line."""
    k = checkpointed_layers(arch, s)
    return "off" if k == 0 else "on" if k == arch.layers else f"{k} of {arch.layers} layers"


def layer_saved_bytes(arch: Arch, s, batch: int, seq: int, checkpointed: bool | None = None) -> int:
    """Bytes autograd keeps for one decoder layer: a layer without checkpointing, or (`checkpointed`,
    default: whether any layer is) the working set of one recomputed in backward."""
    t, h, i = batch * seq, arch.hidden, arch.intermediate
    cb = MP_BYTES[s.mixed_precision]
    checkpointed = checkpointed_layers(arch, s) > 0 if checkpointed is None else checkpointed
    if lean(arch, s):
        # finetune.train.lean: each norm keeps its input; the first one's is the checkpointed layer input
        total = (arch.norms_per_layer - (1 if checkpointed else 0)) * t * h * residual_bytes(arch, s)
    else:
        total = arch.norms_per_layer * (t * h * 4 + t * 4)  # RMSNorm upcasts to fp32 and keeps it + rsqrt
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    if arch.model_type in QK_RMSNORM:  # per-head RMSNorm on q and k: their fp32 input and rsqrt
        total += t * (q + kv) * 4 + t * (arch.heads + arch.kv_heads) * 4
    names = {x.name for x in targeted(arch, s.lora_targets)}
    if tiled(arch, s, t):
        # finetune.train.tiled keeps only the MLP's input (the second norm's output) for the whole layer;
        # one chunk's adapters and intermediates are mlp_chunk_bytes, added once (activation_terms)
        names -= MLP_LINEARS
        total += t * h * residual_bytes(arch, s)
    for x in arch.linears():
        if x.name in names:
            n_tok = t * arch.experts_per_tok // x.count if x.count > 1 else t  # routed tokens per expert
            total += lora_linear_saved(n_tok, x.d_in, x.d_out, s.lora_r, s) * x.count
    total -= shared_lora_inputs(arch, s, t, names)
    total += experts_saved_bytes(arch, s, t)
    if s.attn == "sdpa" and uses_cpu_math_kernel(s.device, s.mixed_precision, s.seq_len):
        # SDPA's math kernel (finetune.plan.attention) upcasts q, k and v (repeated to all heads) to fp32
        # and keeps those with the fp32 probabilities, in place of the bf16 q, k, v and output
        total += 3 * t * q * 4 + batch * arch.heads * seq * seq * 4
    else:
        if s.attn == "eager":
            kv = q  # eager repeats K/V to all heads, then keeps fp32 probabilities and their cast copy
            total += batch * arch.heads * seq * seq * (4 + cb)
        total += t * (2 * q + 2 * kv) * cb + batch * arch.heads * seq * 4  # q, k, v, output + logsumexp
    inter = t * arch.experts_per_tok if arch.experts else t
    # act input, act output and up (gated); lean MLPs recompute the act output. 4-bit experts' matmuls
    # come out of autocast in the compute dtype (no peft Linear promotes them).
    per = MP_BYTES[s.mixed_precision] if arch.experts and s.quant in ("nf4", "fp4") else mlp_bytes(arch, s)
    if not tiled(arch, s, t):
        total += inter * i * per * ((2 if lean(arch, s) else 3) if arch.gated_mlp() else 1)
    if arch.experts:
        total += t * arch.experts * 4 * 2  # router logits and softmax
    return total


def head_saved_bytes(arch: Arch, s, batch: int, seq: int) -> int:
    """Saved at the output head: the final norm's fp32 input and rsqrt, the targets, and then either the
    chunked loss's copy of the trained rows' hidden states and their log-sum-exp, or (full logits) the
    autocast copy of a head stored wider than the compute dtype and the fp32 log-probabilities."""
    t, h, v = batch * seq, arch.hidden, arch.vocab
    rb = residual_bytes(arch, s)
    norm = t * h * rb if lean(arch, s) else t * h * 4 + t * 4
    saved = norm + t * 8
    if s.loss == "chunked":
        return saved + t * h * rb + t * 4
    return saved + _cast_head(arch, s) + t * v * 4


def _cast_head(arch: Arch, s) -> int:
    cb = MP_BYTES[s.mixed_precision]
    return arch.vocab * arch.hidden * cb if DTYPE_BYTES[s.model_dtype] != cb else 0


def loss_working_bytes(arch: Arch, s, tokens: int) -> int:
    """The loss path's transient peak beyond what `head_saved_bytes` keeps, planned for every position
    trained (the bound for data with no masked prompt): one chunk's working set, the hidden states'
    gradient and a transient compute-dtype copy of a wider head; or the full logits' buffers."""
    cb = MP_BYTES[s.mixed_precision]
    if s.loss == "transformers":
        return transformers_loss_bytes(tokens, arch.vocab) - tokens * arch.vocab * 4
    if s.loss == "full":
        return full_logits_bytes(tokens, arch.vocab, cb) - tokens * arch.vocab * 4
    rb = residual_bytes(arch, s)
    path = chunked_loss_bytes(tokens, arch.vocab, arch.hidden, cb, s.loss_chunk_tokens, rb)
    return path - tokens * arch.hidden * rb - tokens * 4 + _cast_head(arch, s)


def first_layer_discount(arch: Arch, s, tokens: int) -> int:
    """The first layer's input (the frozen embedding's output) needs no gradient, so its input norm and
    the dropout on the attention projections it feeds save nothing."""
    saved = tokens * arch.hidden * DTYPE_BYTES[s.model_dtype] if lean(arch, s) else tokens * arch.hidden * 4 + tokens * 4
    if s.lora_dropout > 0:
        mask = 1 if s.device == "cuda" else DTYPE_BYTES[s.lora_dtype]
        attn_in = {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"}
        n = sum(1 for x in targeted(arch, s.lora_targets) if x.name in attn_in)
        if arch.model_type == "falcon":  # parallel attention: the MLP reads the same norm output
            n += sum(1 for x in targeted(arch, s.lora_targets) if x.name == "dense_h_to_4h")
        saved += n * tokens * arch.hidden * mask
    return saved


def held_bytes(arch: Arch, s, k: int | None = None) -> int:
    """What checkpointing keeps for the whole backward: each checkpointed layer's input (`k` of them,
    default all), in the residual dtype. With activation offloading they live in pinned CPU memory, and only
    the layer in use and the one being copied back ahead of it are on the GPU."""
    per_input = s.micro_batch * s.seq_len * arch.hidden * residual_bytes(arch, s)
    k = arch.layers if k is None else k
    layers = min(k, PREFETCHED_LAYERS) if s.activation_offload else k
    return layers * per_input


def activation_terms(arch: Arch, s) -> dict[str, int]:
    """`activations`: what the layers keep plus the larger of the two working phases' layer part;
    `logits_loss`: what the loss phase needs beyond that (0 when the recomputed layer is the larger);
    their sum is the activation part of the peak. `_offloaded`: bytes moved to pinned CPU memory."""
    b, L = s.micro_batch, s.seq_len
    transient = backward_transient_bytes(arch, s)  # one layer's backward at a time
    per_layer = layer_saved_bytes(arch, s, b, L) + mlp_chunk_bytes(arch, s)  # one layer's chunk at a time
    rope = 2 * L * arch.head_dim * 4  # cos/sin tables, shared by all layers
    head = head_saved_bytes(arch, s, b, L)
    loss = head + loss_working_bytes(arch, s, b * L)
    offloaded, k = 0, checkpointed_layers(arch, s)
    if k:
        # The first k layers are checkpointed (train.lora.enable_checkpointing), the rest keep all they save.
        # Backward reaches a checkpointed layer only after every later layer freed its saved tensors, so one
        # recomputed layer never stacks on them: the peak is the end of the forward (kept layers + loss) or
        # a recompute on top of the held inputs, whichever is larger. With k = all, kept is 0.
        held = held_bytes(arch, s, k)
        if s.activation_offload:
            offloaded = arch.layers * b * L * arch.hidden * residual_bytes(arch, s)
        kept = (arch.layers - k) * layer_saved_bytes(arch, s, b, L, checkpointed=False)
        # a kept layer's backward or a recomputed one's, with one layer's backward working set on top
        working = max(kept, per_layer) + transient
        layers = held + rope + working
        extra = max(0, kept + loss - working)  # the end of the forward: kept layers + the loss phase
    else:
        held = 0
        layers = (arch.layers * per_layer - (arch.layers - 1) * mlp_chunk_bytes(arch, s) + rope
                  - first_layer_discount(arch, s, b * L) + transient)
        # every layer's saved tensors are still there when the loss runs; the layers' backwards come after it
        extra = max(0, loss - transient)
    return {"activations": layers, "logits_loss": extra, "_held": held + rope, "_per_layer": per_layer + transient,
            "_head_saved": head, "_offloaded": offloaded, "_transient": transient}


def embedding_on_cpu(arch, s) -> int:
    """Activation offloading keeps an untied, unsharded input-embedding table in CPU memory
    (finetune.train.offload.embeddings_to_cpu)."""
    if not s.activation_offload or s.device != "cuda" or arch.tied or s.strategy == "fsdp":
        return 0
    return arch.vocab * arch.hidden * DTYPE_BYTES[s.model_dtype]
