"""A LoRA adapter as llama.cpp applies it, for `export --adapter-only`.

llama.cpp adds (alpha / r_t) * B @ A to each weight, with one alpha for the whole GGUF (the converter writes
adapter_config's lora_alpha) and r_t each tensor's own rank (llama-adapter.cpp). peft scales a module by
alpha / r, or alpha / sqrt(r) with rsLoRA, with per-module alpha_pattern / rank_pattern. Written as they are,
an rsLoRA adapter of rank 16 ran 4x weaker in llama.cpp than in peft, and every tensor still read back equal.
So the alpha written is chosen for the first module (peft's scale x its rank) and any module whose scale then
differs has its B scaled by the ratio: llama.cpp computes peft's update for every module, which `check_scales`
verifies against the GGUF's alpha after the conversion.

What the format cannot hold is refused before the converter runs (exit 2): DoRA's magnitude vectors (they
renormalize every adapted weight, W' = m * (W + s B A) / ||W + s B A||, which no added B @ A can express), and
every feature `merge` refuses (trained biases, saved modules, trained token embeddings, other adapter types).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from finetune.merge.plan import adapter_problems, pair_keys, scaling
from finetune.util.errors import RecipeError

ALPHA_KEY = "adapter.lora.alpha"  # gguf.Keys.Adapter.LORA_ALPHA at the pinned converter


def refusals(cfg: dict) -> list[str]:
    """Why llama.cpp's LoRA GGUF cannot hold this adapter (empty: it can, after `portable`)."""
    out = []
    if cfg.get("use_dora"):
        out.append("DoRA (use_dora) keeps a magnitude vector per adapted weight that renormalizes it after the LoRA "
                   "update; llama.cpp's LoRA GGUF only adds (alpha/r) B @ A, so the adapter would run as another "
                   "model")
    return out + [p for p in adapter_problems(cfg) if not p.startswith("use_dora")]


def portable(adapter_dir: Path, out_dir: Path) -> tuple[Path, dict]:
    """The adapter llama.cpp applies as peft does: `adapter_dir` itself when its scaling is plain alpha / r_t,
    else a copy in `out_dir` with the alpha written and B scaled per module. Returns (dir to convert, scales:
    {"alpha": written alpha, "modules": {module: peft's scale}, "scaled_b": [modules whose B was scaled]})."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    why = refusals(cfg)
    if why:
        raise RecipeError([f"--adapter-only: {adapter_dir}: {w}; export the merged model instead (without "
                           "--adapter-only), which folds it into the weights" for w in why], "export")
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pairs = pair_keys(tensors)
    scales = {m: scaling(cfg, m, tensors[a].shape[0]) for m, (a, _) in pairs.items()}
    first = next(iter(pairs))
    alpha = scales[first] * tensors[pairs[first][0]].shape[0]  # llama.cpp's alpha / r_t gives peft's scale
    factor = {m: scales[m] * tensors[a].shape[0] / alpha for m, (a, _) in pairs.items()}
    scaled = [m for m, f in factor.items() if not math.isclose(f, 1.0, rel_tol=1e-6)]
    info = {"alpha": alpha, "modules": scales, "scaled_b": scaled,
            "ranks": {m: tensors[a].shape[0] for m, (a, _) in pairs.items()}}
    if not scaled and math.isclose(alpha, float(cfg.get("lora_alpha", 8)), rel_tol=1e-9):
        return adapter_dir, info
    for m in scaled:
        b = pairs[m][1]
        tensors[b] = (tensors[b].float() * factor[m]).to(tensors[b].dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.update(lora_alpha=alpha, use_rslora=False, alpha_pattern={})
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir, info


def check_scales(gguf, gguf_path: Path, info: dict) -> dict:
    """peft's scale of every module against llama.cpp's (the GGUF's alpha / the module's rank x the B scale
    written); {"alpha", "max_rel_diff"}. RuntimeError when they differ (the file is not published)."""
    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get(ALPHA_KEY)
    if field is None:
        raise RuntimeError(f"export: the converter wrote no {ALPHA_KEY}; llama.cpp would apply the adapter at a "
                           "scale of its own")
    alpha = float(field.contents())
    worst, ranks = 0.0, info["ranks"]
    for m, scale in info["modules"].items():
        b_scale = scale * ranks[m] / info["alpha"] if m in info["scaled_b"] else 1.0
        worst = max(worst, abs(alpha / ranks[m] * b_scale - scale) / scale)
    if worst > 1e-6:
        raise RuntimeError(f"export: llama.cpp would scale the adapter differently from peft (relative difference "
                           f"{worst:.3g}); nothing was written")
    return {"alpha": alpha, "max_rel_diff": worst, "scaled_b": len(info["scaled_b"])}
