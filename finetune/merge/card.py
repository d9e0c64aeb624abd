"""The model card (README.md) written next to merged weights: where they came from and how well the
merge reproduces base + adapter. Deterministic text (no timestamps), so a re-run writes the same bytes."""
from __future__ import annotations

import json


def _front_matter(src) -> list[str]:
    base = src.base_name if not src.base_name.startswith("/") else None  # local paths mean nothing elsewhere
    lines = ["---", "library_name: transformers", "tags: [finetune, lora, qlora, merged]"]
    if base and not base.startswith("builtin:"):
        lines.append(f"base_model: {json.dumps(base)}")  # quoted YAML: a line break in a name adds no key
    return lines + ["---", ""]


def _recipe_lines(src) -> list[str]:
    if src.recipe is None:
        return ["## Recipe", "", "Not available: merged from a plain PEFT adapter directory. "
                "`--target nf4` assumes the recipe defaults (nf4, double quant, float32 model dtype).", ""]
    r = src.recipe
    data = ", ".join(f"`{s.path}`" + (f" ({s.split})" if s.split != "train" else "") for s in r.data.sources)
    evals = ", ".join(f"`{s.path}`" for s in r.data.eval_sources) or f"{r.data.eval_split:g} of training rows"
    return ["## Recipe", "",
            f"- quantization during training: {r.quantization.mode}, double quant {r.quantization.double_quant}, "
            f"model dtype {r.model.dtype}, storage {r.effective_quant_storage()}",
            f"- LoRA: r={r.lora.r}, alpha={r.lora.alpha:g}, dropout={r.lora.dropout:g}, "
            f"targets {r.lora.target_modules}",
            f"- schedule: lr {r.train.learning_rate:g} ({r.train.lr_scheduler}), optimizer {r.train.optimizer}, "
            f"max_steps {r.train.max_steps}, epochs {r.train.epochs:g}, seed {r.train.seed}",
            f"- strategy: {r.distributed.strategy}", "",
            "## Data", "", f"- training: {data}", f"- held out: {evals}",
            f"- max_seq_len {r.data.max_seq_len}, packing {r.data.packing}", ""]


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig accepts only these max_lora_rank


def vllm_max_lora_rank(cfg: dict) -> int:
    """The --max-lora-rank vLLM needs for this adapter: the smallest value it accepts >= every rank used."""
    rank = max([int(cfg.get("r") or 0), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())])
    return next((v for v in VLLM_LORA_RANKS if v >= rank), rank)


def serving_lines(src, tokenizer_config: dict) -> list[str]:
    """What the clients need to serve this model as trained (docs/deploy.md has the full commands).
    `tokenizer_config`: the tokenizer_config.json written beside the merged weights."""
    from finetune.artefacts.adapter import base_reference

    cfg = src.adapter_config
    base, _ = base_reference(src.recipe.model.name if src.recipe else src.base_name, src.base_name)
    note = ""
    if base.startswith(("builtin:", "synthetic:")):
        base, note = "BASE_DIR", f"; BASE_DIR: the directory of `{base}` (no hub holds it; finetune builds it)"
    rank = vllm_max_lora_rank(cfg)
    bos = tokenizer_config.get("add_bos_token")
    return ["## Serving", "",
            "- vLLM, merged: `vllm serve MERGED_DIR`; the chat template is in tokenizer_config.json and "
            "chat_template.jinja.",
            f"- vLLM, adapter over the base: `vllm serve {base} --enable-lora --max-lora-rank {rank} "
            f"--lora-modules ft=ADAPTER_DIR` (LoRA r={cfg.get('r')}; vLLM accepts max-lora-rank values "
            f"{', '.join(map(str, VLLM_LORA_RANKS))}, default 16{note}).",
            "- llama.cpp / Ollama: `finetune export RUN_DIR --format gguf`, then `llama-server -m MODEL.gguf "
            "--jinja` (`--jinja` applies the chat template stored in the GGUF; without it llama.cpp falls back "
            "to a built-in template this model was not trained with).",
            f"- tokenizer: add_bos_token {str(bos).lower() if bos is not None else 'unset'} (what training did); "
            f"tokenizer_config.json names class {tokenizer_config.get('tokenizer_class')}, which transformers 4.x "
            "and 5.x both read.", ""]


def model_card(src, target: str, dtype: str, stats: dict, parity: dict, tokenizer_config: dict) -> str:
    cfg = src.adapter_config
    rslora = " (rslora)" if cfg.get("use_rslora") else ""
    scales = ", ".join(f"{s:g}" for s in stats["scales"])
    how = ("the original base weights" if target == "original" else
           "each weight as training saw it (4-bit quantized then dequantized, as bitsandbytes did)")
    lines = _front_matter(src) + [
        "# Merged model", "",
        "Base model and LoRA adapter folded into one set of weights by `finetune merge`; load it with plain "
        "`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.", "",
        "## Sources", "",
        f"- base: `{src.base_name}`",
        f"- adapter: `{src.adapter_dir}` (r={cfg.get('r')}, alpha={cfg.get('lora_alpha')}{rslora}, "
        f"scale {scales}, {stats['merged_weights']} weights updated)",
        f"- run dir: `{src.run_dir}`" if src.run_dir else "- run dir: none (plain PEFT adapter)", "",
        "## Merge", "",
        f"- target: `{target}`: the update (alpha/r) * B @ A was added in fp32 to {how}",
        f"- written dtype: {dtype}; {stats['shards']} safetensors shard(s), {stats['bytes']:,} bytes", "",
        "## Parity check", ""]
    if parity["status"].startswith("skipped"):
        lines += [f"- {parity['status']}", ""]
    else:
        lines += [f"- result: **{parity['status']}**: {parity['summary']}",
                  f"- details: `{json.dumps({k: v for k, v in parity.items() if k != 'summary'}, sort_keys=True)}`",
                  ""]
    return "\n".join(lines + serving_lines(src, tokenizer_config) + _recipe_lines(src))
