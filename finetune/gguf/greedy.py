"""Greedy generations of a merged GGUF in llama.cpp (llama-cpp-python) against transformers on the same merged
weights, on the run's held-out prompts: token ids of every prompt and every continuation must be equal.

Both sides run one prompt at a time, without padding, in float32 on the transformers side (the merged weights
widened exactly), stopping at EOS or `eval.max_new_tokens`. The prompt is tokenized by each side's own
tokenizer with its special-token rule (transformers: add_special_tokens=True; llama.cpp: the GGUF's
add_bos_token), so a BOS one side adds and the other does not shows up as a prompt mismatch.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch


def heldout_prompts(run_dir: Path, tok, n: int) -> tuple[list[tuple[str, str]], int]:
    """(prompt, expected completion) of the first `n` held-out rows of the run's recipe, and its max_new_tokens."""
    from finetune.data import encode
    from finetune.data.prepare import prepare
    from finetune.recipe.rundir import read_recipe

    recipe = read_recipe(run_dir)
    out = []
    for row in prepare(recipe.data, tok).eval_rows:
        if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            out.append((row["prompt"], row["completion"]))
        elif isinstance(row.get("instruction"), str) and isinstance(row.get("output"), str):
            out.append((encode.instruction_prompt(row), row["output"]))
        elif isinstance(row.get("messages"), list) and row["messages"] and row["messages"][-1].get("role") == "assistant":
            prompt = tok.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
            out.append((prompt, row["messages"][-1].get("content", "")))
        if len(out) == n:
            break
    return out, recipe.eval.max_new_tokens


@torch.no_grad()
def _hf_greedy(model, tok, ids: list[int], max_new: int) -> list[int]:
    gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    new = gen[0, len(ids):].tolist()
    return new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new


def _llama_greedy(llm, ids: list[int], max_new: int, eos: int) -> list[int]:
    """temp 0 is llama.cpp's greedy sampler; stop at the same EOS id transformers stops at."""
    out = []
    for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if t == eos:
            break
        out.append(int(t))
        if len(out) >= max_new:
            break
    return out


def greedy_parity(run_dir: Path, merged_dir: Path, gguf_file: Path, n: int) -> dict:
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(merged_dir)
    prompts, max_new = heldout_prompts(run_dir, tok, n)
    model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    llm = Llama(model_path=str(gguf_file), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    same_prompt = same_out = hf_em = ll_em = 0
    first_diff = None
    for prompt, expected in prompts:
        hf_ids = tok(prompt)["input_ids"]
        ll_ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        same_prompt += hf_ids == ll_ids
        hf_out = _hf_greedy(model, tok, hf_ids, max_new)
        ll_out = _llama_greedy(llm, hf_ids, max_new, tok.eos_token_id)  # same prompt ids: compare the models
        same_out += hf_out == ll_out
        hf_em += tok.decode(hf_out, skip_special_tokens=True).strip() == expected.strip()
        ll_em += tok.decode(ll_out, skip_special_tokens=True).strip() == expected.strip()
        if first_diff is None and (hf_ids != ll_ids or hf_out != ll_out):
            first_diff = {"prompt": prompt, "hf": hf_out, "llama_cpp": ll_out, "prompt_ids_equal": hf_ids == ll_ids}
    k = len(prompts)
    ok = k > 0 and same_prompt == k and same_out == k
    return {"status": "passed" if ok else "failed", "prompts": k, "prompt_ids_equal": same_prompt,
            "outputs_equal": same_out, "exact_match_transformers": hf_em / max(k, 1),
            "exact_match_llama_cpp": ll_em / max(k, 1), "first_difference": first_diff,
            "summary": f"{same_out}/{k} greedy outputs and {same_prompt}/{k} prompt tokenizations equal"}
