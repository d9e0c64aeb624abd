"""What `finetune eval` and `finetune generate` run: outside any FSDP wrapper, in one process, from RUN_DIR alone.

The base is loaded exactly as training saw it (same quantization), the adapter from RUN_DIR/adapter.
`eval` reports held-out loss with and without the adapter, and greedy exact match on prompt/completion rows.
"""
from __future__ import annotations

from pathlib import Path

import torch

from finetune.data import batching, encode
from finetune.data.prepare import prepare
from finetune.plan.archs import vocab_size
from finetune.recipe.rundir import read_recipe
from finetune.train.device import model_device, to_model_device
from finetune.util.errors import RecipeError


def load_run(run_dir: Path):
    """(recipe, tokenizer, PeftModel over the quantized base) for a finished run."""
    from peft import PeftModel

    from finetune.train.model import load_model, load_tokenizer

    adapter = run_dir / "adapter"
    if not (run_dir / "recipe.yaml").exists() or not (adapter / "adapter_config.json").exists():
        raise RecipeError([f"{run_dir}: not a finished run dir (needs recipe.yaml and adapter/)"])
    recipe = read_recipe(run_dir)
    if not (adapter / "adapter_model.safetensors").exists() and not recipe.model.allow_pickle:
        # PEFT would fall back to adapter_model.bin: a pickle, which can run code when loaded.
        raise RecipeError([f"{adapter}: no adapter_model.safetensors (pickle adapters are refused); convert it, "
                           "or set model.allow_pickle: true in its recipe.yaml"])
    tok = load_tokenizer(recipe.model, path=str(adapter))
    base = load_model(recipe.model, recipe.quantization, quiet=True)
    model = PeftModel.from_pretrained(base, str(adapter))
    model.eval()
    return recipe, tok, model


def _prompt_completion(row: dict) -> tuple[str, str] | None:
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return row["prompt"], row["completion"]
    if isinstance(row.get("instruction"), str) and isinstance(row.get("output"), str):
        return encode.instruction_prompt(row), row["output"]
    return None


@torch.no_grad()
def greedy(model, tok, prompts: list[str], max_new_tokens: int, batch_size: int = 16) -> list[str]:
    tok.padding_side = "left"  # generation continues from the right end of every row
    out = []
    for i in range(0, len(prompts), batch_size):
        enc = to_model_device(model, tok(prompts[i: i + batch_size], return_tensors="pt", padding=True))
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def exact_match(model, tok, rows: list[dict], n: int, max_new_tokens: int) -> float | None:
    pairs = [p for p in (_prompt_completion(r) for r in rows) if p][:n]
    if not pairs:
        return None
    outs = greedy(model, tok, [p for p, _ in pairs], max_new_tokens)
    return sum(o.strip() == c.strip() for o, (_, c) in zip(outs, pairs)) / len(pairs)


def heldout_loss(model, examples, recipe) -> float:
    from finetune.train.loss import loss_totals

    device = model_device(model)
    batches = batching.batches(examples, recipe.train.micro_batch_size, 0, False, recipe.data.max_seq_len)
    total, count = loss_totals(model, batches, device.type, recipe.train, recipe.eval.max_batches, device=device)
    return total / max(count, 1)


def run_eval(run_dir: Path) -> dict:
    recipe, tok, model = load_run(run_dir)
    prepared = prepare(recipe.data, tok, vocab_size(recipe.model.name))
    if not prepared.eval:
        raise RecipeError(["data: no held-out rows; set data.eval_sources or data.eval_split > 0"])
    n, mnt = recipe.eval.exact_match_samples, recipe.eval.max_new_tokens
    res = {"eval_loss": heldout_loss(model, prepared.eval, recipe),
           "exact_match": exact_match(model, tok, prepared.eval_rows, n, mnt)}
    with model.disable_adapter():
        res["base_eval_loss"] = heldout_loss(model, prepared.eval, recipe)
        res["base_exact_match"] = exact_match(model, tok, prepared.eval_rows, n, mnt)
    res["eval_rows"] = len(prepared.eval)
    res["perplexity"] = float(torch.exp(torch.tensor(res["eval_loss"])))
    return res
