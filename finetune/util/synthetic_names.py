"""Synthetic model names: `synthetic:BASE?layers=2&hidden=1024&seed=0`, a model with BASE's architecture
(a name of the built-in table, a hub id in the HF cache, `builtin:tiny-llama`, or a directory with a
config.json), the shapes the options change, and seeded random weights. `weights/built/synthetic.py` builds the
weights (sharded bf16 safetensors plus the tiny tokenizer) into the cache the first time the name is used;
this module is the pure part: parsing, the config, and the cache directory.
"""
from __future__ import annotations

import hashlib
from urllib.parse import parse_qsl

from finetune.util.builtin import cache_root
from finetune.util.errors import RecipeError

PREFIX = "synthetic:"
VERSION = "v4"  # bump when the builder changes
# option -> config.json key
OPTIONS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "intermediate": "intermediate_size",
           "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "vocab": "vocab_size",
           "head_dim": "head_dim", "experts": "num_experts", "experts_per_tok": "num_experts_per_tok",
           "moe_intermediate": "moe_intermediate_size"}
DEVICES = ("cpu", "cuda")
# The experts count's key differs between families: Mixtral's num_local_experts, Qwen3-MoE's num_experts.
_EXPERT_KEYS = ("num_local_experts", "num_experts")


def is_synthetic(name: str) -> bool:
    return name.startswith(PREFIX)


def parse(name: str, what: str = "model.name") -> tuple[str, dict, int]:
    """(base name, config overrides, seed) of a synthetic name; RecipeError naming `what` otherwise."""
    base, _, query = name[len(PREFIX):].partition("?")
    if not base:
        raise RecipeError([f"{what}: '{name}' names no base architecture (synthetic:BASE?layers=N...)"])
    overrides, seed = {}, 0
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key == "device":
            if value not in DEVICES:
                raise RecipeError([f"{what}: '{name}': device={value!r}; known: {', '.join(DEVICES)}"])
            continue
        if not value.isdigit() or int(value) <= 0 and key != "seed":
            raise RecipeError([f"{what}: '{name}': {key}={value!r} is not a positive integer"])
        if key == "seed":
            seed = int(value)
        elif key in OPTIONS:
            overrides[OPTIONS[key]] = int(value)
        else:
            raise RecipeError([f"{what}: '{name}': unknown option {key!r}; known: seed, device, "
                               f"{', '.join(OPTIONS)}"])
    return base, overrides, seed


def draw_device(name: str) -> str:
    """Where the builder draws the random weights: `device=cuda` draws them on the GPU (an 8B model in
    seconds instead of minutes on one core). The values differ from the CPU's draw for the same seed (another
    generator), so the option is part of the name and of the cache directory."""
    return dict(parse_qsl(name.partition("?")[2])).get("device", "cpu")


def config_for(base_config: dict, overrides: dict) -> dict:
    """The synthetic model's config.json: the base's, with the overrides; a changed hidden size or head count
    drops an explicit head_dim that no longer divides it (the model then derives it)."""
    cfg = {k: v for k, v in base_config.items() if not k.startswith("_")}
    overrides = dict(overrides)
    if "num_experts" in overrides:
        key = next((k for k in _EXPERT_KEYS if k in cfg), "num_experts")
        overrides[key] = overrides.pop("num_experts")
    cfg.update(overrides)
    if "num_hidden_layers" in overrides:
        _keep_layer_pattern(cfg)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        # The builder sets these to the tiny tokenizer's ids; a class default past a smaller vocabulary
        # (Phi-3's pad id 32000) would fail the model's constructor before that.
        cfg[k] = None
    changed = {"hidden_size", "num_attention_heads"} & set(overrides)
    if changed and "head_dim" not in overrides and cfg.get("head_dim") and cfg.get("num_attention_heads"):
        if cfg["head_dim"] * cfg["num_attention_heads"] != cfg.get("hidden_size"):
            cfg.pop("head_dim")
    for k in ("quantization_config", "auto_map"):  # random weights are never pre-quantized or remote code
        cfg.pop(k, None)
    return cfg


def cache_dir(name: str):
    """Where the synthetic model `name` is built: one directory per exact name."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return cache_root() / f"synthetic-{VERSION}-{digest}"


def _keep_layer_pattern(cfg: dict) -> None:
    """A model with sliding-window and global attention layers (Gemma 3: five sliding to one global) keeps
    both kinds when a synthetic copy has fewer layers: the base's pattern, cut to the new depth, with the
    last layer global (the end of every published period), so a 2-layer copy runs one of each."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    period = cfg.get("sliding_window_pattern")
    if types is None and period:
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(max(n, period))]
    if not types:
        return
    types = list(types[:n]) + [types[-1]] * max(0, n - len(types))
    if "sliding_attention" in types:
        types[-1] = "full_attention"
    cfg["layer_types"] = types


# ----------------------------------------------------------------------------------- token data

TOKENS = "synthetic:tokens"
TOKEN_OPTIONS = {"rows": 1000, "min_len": 32, "max_len": 256, "vocab": 0, "seed": 0}


def is_synthetic_tokens(path: str) -> bool:
    return path == TOKENS or path.startswith(TOKENS + "?")


def parse_tokens(path: str, what: str = "data.sources[].path") -> dict:
    """Options of a synthetic token source `synthetic:tokens?rows=N&min_len=A&max_len=B&vocab=V&seed=S`
    (defaults in TOKEN_OPTIONS, min_len at most max_len; vocab 0: the model's), RecipeError naming `what` otherwise."""
    opts, given = dict(TOKEN_OPTIONS), set()
    for key, value in parse_qsl(path[len(TOKENS):].lstrip("?"), keep_blank_values=True):
        if key not in opts:
            raise RecipeError([f"{what}: '{path}': unknown option {key!r}; known: {', '.join(TOKEN_OPTIONS)}"])
        if not value.isdigit() or (int(value) <= 0 and key not in ("seed", "vocab")):
            raise RecipeError([f"{what}: '{path}': {key}={value!r} is not a positive integer"])
        opts[key] = int(value)
        given.add(key)
    if "min_len" not in given:  # a short max_len alone asks for short rows
        opts["min_len"] = min(opts["min_len"], opts["max_len"])
    if opts["min_len"] < 2 or opts["min_len"] > opts["max_len"]:
        raise RecipeError([f"{what}: '{path}': need 2 <= min_len <= max_len, got {opts['min_len']} and "
                           f"{opts['max_len']}"])
    return opts


def token_rows(opts: dict, split: str, vocab: int):
    """Seeded random token rows, {"input_ids": [...]} each, lengths uniform in [min_len, max_len] and ids
    uniform over the whole vocabulary, so a model with any vocabulary (not only the tiny tokenizer's) gets
    data that reaches every row of its embedding and head. Each split draws from its own stream."""
    import random

    rng = random.Random(f"{opts['seed']}:{split}")  # str seeds hash deterministically (not by PYTHONHASHSEED)
    for _ in range(opts["rows"]):
        n = rng.randint(opts["min_len"], opts["max_len"])
        yield {"input_ids": [rng.randrange(vocab) for _ in range(n)]}
