"""Model shapes for the memory planner, read without weights and without importing torch or transformers.

`resolve(name)` finds a model's `config.json` (a local directory, the local Hugging Face cache, or
`builtin:tiny-llama`) and falls back to a built-in table of common architectures under their hub ids, so a
70B run can be planned on a laptop with nothing downloaded. The table (architectures.json beside this module)
holds public architecture facts (hidden size, layers, heads, KV heads, intermediate size, vocabulary, tied
embeddings, MoE experts) in the same keys config.json uses, so both paths go through one parser.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Hub id -> config.json keys of common architectures, and instruct/renamed ids -> the id that holds their shapes.
_KNOWN = json.loads((Path(__file__).parent / "architectures.json").read_text())
TABLE: dict[str, dict] = _KNOWN["models"]
ALIASES: dict[str, str] = _KNOWN["aliases"]

# Decoder layer class per model_type: what FSDP wraps and checkpointing recomputes.
LAYER_CLASS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "mixtral": "MixtralDecoderLayer",
               "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer", "qwen3_moe": "Qwen3MoeDecoderLayer",
               "gemma2": "Gemma2DecoderLayer", "gemma3": "Gemma3DecoderLayer", "gemma3_text": "Gemma3DecoderLayer",
               "phi3": "Phi3DecoderLayer", "falcon": "FalconDecoderLayer"}
# Families with RMSNorms on each head's queries and keys (QK-norm): two head_dim weights a layer.
QK_NORM = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text"}
# Families with pre- and post-feedforward norms besides the two of a Llama layer.
FOUR_NORMS = {"gemma2", "gemma3", "gemma3_text"}


# How a hub checkpoint stores the experts that transformers 5 fuses into 3-D parameters: per expert, one
# 2-D weight per projection, under the layer's `<prefix>.<e>.` (transformers' conversion_mapping.py
# stacks them at load time; the streaming loader and the merge do the same, tensor by tensor).
# model_type -> (the fused module path, the checkpoint's, {fused parameter: the projections stacked in it,
# concatenated along its rows in this order}); `renames`: other keys the checkpoint spells differently.
EXPERT_LAYOUTS = {
    "mixtral": ("mlp.experts", "block_sparse_moe.experts", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
    "qwen3_moe": ("mlp.experts", "mlp.experts", {"gate_up_proj": ("gate_proj", "up_proj"),
                                                 "down_proj": ("down_proj",)}),
}
EXPERT_RENAMES = {"mixtral": (("mlp.gate.weight", "block_sparse_moe.gate.weight"),)}
# The router balance loss's weight Mixtral's and Qwen3-MoE's configs hold when config.json names none
# (transformers 5.23 MixtralConfig, Qwen3MoeConfig): what train.router_aux_loss_coef: null then trains.
ROUTER_AUX_LOSS_COEF = 0.001


def per_expert_keys(name: str, model_type: str, experts: int) -> list[list[str]] | None:
    """The checkpoint keys a fused expert parameter `name` is stacked from: one list per expert, its parts
    in row order (Mixtral's `...mlp.experts.gate_up_proj` -> [[...block_sparse_moe.experts.0.w1.weight,
    ...experts.0.w3.weight], ...]). None when `name` is no fused expert parameter of this family."""
    layout = EXPERT_LAYOUTS.get(model_type)
    if layout is None:
        return None
    fused, stored, params = layout
    module, _, param = name.rpartition(".")
    if not module.endswith(fused) or param not in params:
        return None
    prefix = module[: len(module) - len(fused)] + stored
    return [[f"{prefix}.{e}.{part}.weight" for part in params[param]] for e in range(experts)]


def renamed_key(name: str, model_type: str) -> str | None:
    """The checkpoint's spelling of a non-expert parameter the model names differently (Mixtral's router)."""
    for ours, theirs in EXPERT_RENAMES.get(model_type, ()):
        if name.endswith(ours):
            return name[: len(name) - len(ours)] + theirs
    return None


@dataclass(frozen=True)
class Linear:
    name: str
    d_in: int
    d_out: int
    count: int = 1  # copies per layer (MoE experts)


@dataclass(frozen=True)
class Arch:
    """The shape facts the planner needs; built from a config.json dict by `from_config`."""

    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0
    experts_per_tok: int = 0
    qkv_bias: bool = False
    router_aux_loss_coef: float = 0.0  # the config's balance-loss weight (MoE; 0 on a dense model)

    @property
    def layer_class(self) -> str:
        return LAYER_CLASS.get(self.model_type, "DecoderLayer")

    @property
    def norms_per_layer(self) -> int:
        return 4 if self.model_type in FOUR_NORMS else 2  # Gemma 2/3 add pre- and post-feedforward norms

    @property
    def norm_has_bias(self) -> bool:
        return self.model_type == "falcon"

    def linears(self) -> list[Linear]:
        """Every `nn.Linear` of one decoder layer, as peft's `all-linear` sees it and bitsandbytes quantizes
        it (the layer names match each architecture's modules, so a target list like [q_proj, v_proj]
        selects from here). MoE experts are not here: see `expert_params`."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        if self.model_type == "falcon":
            return [Linear("query_key_value", h, q + 2 * kv), Linear("dense", q, h),
                    Linear("dense_h_to_4h", h, i), Linear("dense_4h_to_h", i, h)]
        if self.model_type == "phi3":
            return [Linear("qkv_proj", h, q + 2 * kv), Linear("o_proj", q, h),
                    Linear("gate_up_proj", h, 2 * i), Linear("down_proj", i, h)]
        attn = [Linear("q_proj", h, q), Linear("k_proj", h, kv), Linear("v_proj", h, kv), Linear("o_proj", q, h)]
        if self.experts:
            return attn  # the router and the experts are parameters, not nn.Linear (transformers 5)
        return attn + [Linear("gate_proj", h, i), Linear("up_proj", h, i), Linear("down_proj", i, h)]

    def expert_params(self) -> list[Linear]:
        """The MoE experts of one decoder layer. Under transformers 5 (Mixtral, Qwen3-MoE) they are two 3-D
        `nn.Parameter`s of the `experts` module, all experts fused: gate_up_proj [E, 2i, h] and down_proj
        [E, h, i]. bitsandbytes' quantizer swaps only nn.Linear, so they stay in the model dtype; peft
        reaches them through `target_parameters` (one A and one B per parameter, rank r x E)."""
        h, i, e = self.hidden, self.intermediate, self.experts
        if not e:
            return []
        return [Linear("experts.gate_up_proj", h, 2 * i, e), Linear("experts.down_proj", i, h, e)]

    def router_params(self) -> int:
        """Router weights of one layer ([E, h], a parameter, never quantized or adapted)."""
        return self.experts * self.hidden
    def gated_mlp(self) -> bool:
        return self.model_type != "falcon"

    def params(self) -> int:
        """Total parameter count (quantizable linears + embeddings + head + norms + biases)."""
        lin = sum(x.d_in * x.d_out * x.count for x in self.linears() + self.expert_params()) * self.layers
        emb = self.vocab * self.hidden * (1 if self.tied else 2)  # a tied head is the embedding: counted once
        return lin + emb + self.small_params()

    def small_params(self) -> int:
        """Norm weights (and biases), QK-norm weights, linear biases and MoE routers: small, never quantized."""
        per_norm = self.hidden * (2 if self.norm_has_bias else 1)
        norms = (self.layers * self.norms_per_layer + 1) * per_norm
        qk = self.layers * 2 * self.head_dim if self.model_type in QK_NORM else 0
        bias = self.layers * (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return norms + qk + bias + self.layers * self.router_params()


def from_config(cfg: dict, name: str = "") -> Arch:
    """Parse a config.json dict (the keys differ a little between families)."""
    if "text_config" in cfg and not cfg.get("hidden_size"):
        # A multimodal checkpoint (Gemma 3 4B-27B): the decoder's shapes are its text_config.
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                    cfg["text_config"].get("tie_word_embeddings"))}
    g = cfg.get
    hidden = g("hidden_size") or g("n_embd") or g("d_model")
    layers = g("num_hidden_layers") or g("n_layer") or g("num_layers")
    heads = g("num_attention_heads") or g("n_head")
    if not (hidden and layers and heads):
        raise ValueError(f"{name or 'config'}: no hidden_size / num_hidden_layers / num_attention_heads")
    mt = g("model_type", "llama")
    if mt == "falcon":
        kv = (g("num_kv_heads") or g("n_head_kv") or 1) if g("new_decoder_architecture") or g("multi_query") \
            else heads
        inter = g("ffn_hidden_size") or 4 * hidden
    else:
        kv = g("num_key_value_heads") or heads
        # MoE: the experts' width (Qwen3-MoE names it apart; Mixtral's intermediate_size is the experts')
        inter = g("moe_intermediate_size") or g("intermediate_size") or 4 * hidden
    head_dim = g("head_dim") or hidden // heads
    tied = g("tie_word_embeddings")
    experts = int(g("num_local_experts") or g("num_experts") or 0)
    aux = g("router_aux_loss_coef")
    if tied is None:
        tied = mt in ("falcon", "gemma", "gemma2", "gemma3", "gemma3_text")
    return Arch(name=name, model_type=mt, hidden=int(hidden), layers=int(layers), heads=int(heads),
                kv_heads=int(kv), head_dim=int(head_dim), intermediate=int(inter), vocab=int(g("vocab_size")),
                tied=bool(tied), experts=experts, experts_per_tok=int(g("num_experts_per_tok") or 0),
                qkv_bias=bool(g("attention_bias") or mt == "qwen2"),
                router_aux_loss_coef=float(ROUTER_AUX_LOSS_COEF if aux is None else aux) if experts else 0.0)


def _hf_cache_config(repo_id: str) -> Path | None:
    """config.json of a hub model already in the local HF cache (newest snapshot), without network."""
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" /
                                                                     "huggingface")) / "hub")
    snaps = hub / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    if not snaps.is_dir():
        return None
    found = sorted(snaps.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def find_config(name: str) -> tuple[dict | None, str]:
    """(config dict or None, where it came from)."""
    from finetune.util import synthetic_names as synthetic

    if synthetic.is_synthetic(name):
        base, overrides, _ = synthetic.parse(name)
        cfg, where = find_config(base)
        return (None, where) if cfg is None else (synthetic.config_for(cfg, overrides), f"synthetic ({where})")
    if name.startswith("builtin:"):
        from finetune.util import builtin as tiny  # light: imports torch only when the model is first built

        builder = tiny.BUILTIN_MODELS.get(name)
        if builder is None:
            return None, f"unknown builtin model {name!r}; known: {', '.join(tiny.BUILTIN_MODELS)}"
        path = Path(builder()) / "config.json"
        return json.loads(path.read_text()), str(path)
    local = Path(name).expanduser()
    if (local / "config.json").is_file():
        return json.loads((local / "config.json").read_text()), str(local / "config.json")
    cached = _hf_cache_config(name)
    if cached:
        return json.loads(cached.read_text()), str(cached)
    key = ALIASES.get(name, name)
    if key in TABLE:
        return dict(TABLE[key]), f"built-in table ({key})"
    lowered = {k.lower(): k for k in list(TABLE) + list(ALIASES)}
    if name.lower() in lowered:
        return find_config(lowered[name.lower()])
    return None, "not found"


def vocab_size(name: str) -> int | None:
    """The model's vocabulary (rows of its input embedding), or None when its config is not found."""
    cfg, _ = find_config(name)
    try:
        return from_config(cfg, name).vocab if cfg else None
    except (ValueError, TypeError):
        return None


def resolve(name: str) -> tuple[Arch, str]:
    """Arch for a model name, or ValueError naming where we looked and what is known."""
    cfg, where = find_config(name)
    if cfg is None:
        known = ", ".join(sorted(TABLE))
        raise ValueError(f"model {name!r}: {where}: no config.json in a local directory or the HF cache, and not "
                         f"in the built-in table ({known})")
    return from_config(cfg, name), where
