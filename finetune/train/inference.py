"""What `finetune eval` and `finetune generate` run: outside any FSDP wrapper, in one process, from RUN_DIR alone.

The base is loaded exactly as training saw it (same quantization), the adapter from RUN_DIR/adapter (or
the merged model `finetune merge` wrote). Prompts are the token ids training gave them (data.encode's
`prompt_ids`): chats rendered with the same template up to the assistant's turn. `eval` reports held-out
loss with and without the adapter, and greedy exact match (both sides stripped of surrounding whitespace)
of the completion of prompt/completion and instruction rows and of the last assistant turn of chat rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.data import batching, encode
from finetune.data.prepare import prepare
from finetune.data.template import check as check_template
from finetune.plan.archs import vocab_size
from finetune.recipe.rundir import read_recipe
from finetune.data.transfer import model_device, to_model_device
from finetune.util.errors import RecipeError


def load_run(run_dir: Path, merged: bool = False):
    """(recipe, tokenizer, model) for a finished run: a PeftModel over the quantized base, or with
    `merged`, the merged model in RUN_DIR/merged (or RUN_DIR itself when it is a merged model's dir)."""
    from peft import PeftModel

    from finetune.train.runcheck import checked_run
    from finetune.weights.experts.expert_lora import adopt
    from finetune.artefacts.adapter import quiet_peft_wrap
    from finetune.weights.load.model import load_model
    from finetune.weights.load.resolve import load_tokenizer

    if merged:
        return load_merged(run_dir)
    recipe = checked_run(run_dir)
    adapter = run_dir / "adapter"
    tok = load_tokenizer(recipe.model, path=str(adapter))
    check_template(tok, encode.chat_template(recipe.data, tok))  # a hostile or looping template: now, not mid-run
    base = load_model(recipe.model, recipe.quantization, quiet=True)
    with quiet_peft_wrap():
        model = PeftModel.from_pretrained(base, str(adapter))
    adopt(model)  # 4-bit experts take the adapter through expert_lora.PackedExpertsLora
    model.eval()
    return recipe, tok, model


def load_merged(path: Path):
    """(recipe or None, tokenizer, model) of a merged model: PATH/merged, or PATH itself; the recipe is the
    run's when PATH is a run dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = path / "merged" if (path / "merged" / "config.json").exists() else path
    if not (model_dir / "config.json").exists():
        raise RecipeError([f"{path}: no merged model (neither {path}/merged/config.json nor {path}/config.json); "
                           f"run `finetune merge {path}` first"])
    recipe = read_recipe(path) if (path / "recipe.yaml").exists() else None
    from finetune.util.untrusted import remote_code_problem, safetensors_problem

    why = remote_code_problem(model_dir, recipe is not None and recipe.model.trust_remote_code)
    bad = [f"{f}: {w}; re-run `finetune merge`" for f in sorted(model_dir.glob("*.safetensors"))
           for w in [safetensors_problem(f)] if w]
    if why or bad:
        raise RecipeError([why] if why else bad)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    check_template(tok, encode.chat_template(recipe.data, tok) if recipe is not None else tok.chat_template)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto", use_safetensors=True)
    model.eval()
    return recipe, tok, model


def trains_chat(recipe, tok) -> bool:
    """Whether the recipe's training rows are chats (messages, sharegpt, conversational prompt/completion,
    or text rows in the chat layout, encode.chat_layout); for `format: auto` and prompt_completion the first
    row of each source decides."""
    from finetune.data.formats import BadRows
    from finetune.data.sources import iter_rows
    from finetune.util.log import log

    if encode.chat_layout(recipe.data, tok):  # every text prompt trained as a user turn
        return True
    for src in recipe.data.sources:
        if src.format in ("messages", "sharegpt"):
            return True
        if src.format not in ("auto", "prompt_completion"):
            continue
        try:
            row = next(iter_rows(src, BadRows("skip")), {})
        except (OSError, RecipeError) as e:  # the data moved since training: say so, prompt as plain text
            log.warning(f"generate: cannot read {src.path} to see whether it is chat data ({e}); pass --chat if so")
            continue
        if encode.chat_messages(row) is not None:
            return True
    return False


def _prompt(row: dict, chat_layout: bool = False):
    """(prompt, expected answer) of a held-out row: a text prompt, or the messages before a chat's last
    assistant turn; None for rows without one (text). With `chat_layout` (encode.chat_layout)
    instruction and prompt/completion rows are prompted as the user turn they trained as."""
    def text(prompt: str):  # a text prompt as it trained: the user turn, or the text itself
        return [{"role": "user", "content": prompt}] if chat_layout else prompt

    if "chosen" in row and "rejected" in row:  # a preference pair: its chosen answer is the expected one
        prompt, chosen, _ = encode.pair_prompt(row)
        return (text(prompt), chosen) if isinstance(chosen, str) else (prompt, chosen[-1]["content"])
    chat = encode.last_turn(row)
    if chat:
        return chat
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return text(row["prompt"]), row["completion"]
    if isinstance(row.get("instruction"), str) and isinstance(row.get("output"), str):
        return text(encode.instruction_user(row) if chat_layout else encode.instruction_prompt(row)), row["output"]
    return None


def stop_ids(tok, template: str | None) -> list[int]:
    """End of sequence, and the special token that closes an assistant turn in `template` (Llama 3's
    <|eot_id|>, ChatML's <|im_end|>): a chat answer ends there even when it is not the eos token."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if template:
        marker = "\x00answer\x00"
        text = encode.render_chat(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                  template)
        after = tok(text[text.find(marker) + len(marker):], add_special_tokens=False)["input_ids"]
        if after and after[0] in tok.all_special_ids and after[0] not in ids:
            ids.append(after[0])
    return ids


class ContextOverflow(RecipeError):
    """A prompt and its answer do not fit the model's context (chat drops old turns on this one alone)."""


def check_context(model, tok, prompts: list, template: str | None, max_new_tokens: int) -> None:
    """Each prompt plus `max_new_tokens` must fit the model's context (max_position_embeddings): past it the
    positions have no trained meaning, and a huge --max-new-tokens would run for hours (exit 2)."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not context:
        return
    longest = max(len(encode.prompt_ids(tok, p, template)) for p in prompts)
    if longest + max_new_tokens > context:
        which = "--prompt" if longest >= context else "--max-new-tokens"
        raise ContextOverflow([f"{which}: the longest prompt has {longest} tokens and --max-new-tokens is {max_new_tokens}"
                           f", more than the model's context of {context} tokens; shorten the prompt or give "
                           f"--max-new-tokens at most {max(context - longest, 0)}"])


@torch.no_grad()
def generate(model, tok, prompts: list, template: str | None, max_new_tokens: int, sampling: dict | None = None,
             batch_size: int = 16) -> list[str]:
    """Continuations of `prompts` (texts or message lists, see encode.prompt_ids): greedy, or sampled with
    `sampling` ({"temperature", "top_p"}, seeded by the caller) through transformers' GenerationConfig."""
    from transformers import GenerationConfig

    sampling = sampling or {}
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=bool(sampling.get("temperature")),
                              pad_token_id=tok.pad_token_id, eos_token_id=stop_ids(tok, template),
                              **({k: v for k, v in sampling.items() if v is not None} if sampling.get("temperature")
                                 else {}))
    tok.padding_side = "left"  # generation continues from the right end of every row
    out = []
    for i in range(0, len(prompts), batch_size):
        ids = [{"input_ids": encode.prompt_ids(tok, p, template)} for p in prompts[i: i + batch_size]]
        enc = to_model_device(model, tok.pad(ids, padding=True, return_tensors="pt"))
        gen = model.generate(**enc, generation_config=config)
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def greedy(model, tok, prompts: list, max_new_tokens: int, template: str | None = None) -> list[str]:
    """Greedy continuations of `prompts` (see `generate`)."""
    return generate(model, tok, prompts, template, max_new_tokens)


def exact_match(model, tok, rows: list[dict], n: int, max_new_tokens: int, template: str | None,
                record: list | None = None, chat_layout: bool = False) -> float | None:
    """The share of held-out prompts answered exactly; `record` receives (prompt, expected, output) of each."""
    pairs = [p for p in (_prompt(r, chat_layout) for r in rows) if p][:n]
    if not pairs:
        return None
    outs = generate(model, tok, [p for p, _ in pairs], template, max_new_tokens)
    if record is not None:
        record.extend((p, c, o) for (p, c), o in zip(pairs, outs))
    return sum(o.strip() == c.strip() for o, (_, c) in zip(outs, pairs)) / len(pairs)


def heldout_loss(model, examples, recipe) -> float:
    from tqdm.auto import tqdm

    from finetune.train.loss import loss_totals
    from finetune.util.log import is_main

    device = model_device(model)
    batches = batching.batches(examples, recipe.train.micro_batch_size, 0, False, recipe.data.max_seq_len)
    # Progress on large sets, on the main process's terminal only (None: tqdm's own "not a terminal" check),
    # so logs and captured output hold no bar frames.
    quiet = len(batches) < 8 or not is_main()
    batches = tqdm(batches, desc="held-out loss", leave=False, disable=True if quiet else None)
    total, count = loss_totals(model, batches, device.type, recipe.train, recipe.eval.max_batches, device=device)
    return total / max(count, 1)


def preference_metrics(model, examples, recipe) -> dict:
    """The policy's own preference on held-out pairs, which needs no reference model: the share of pairs whose
    chosen answer gets the higher summed log-prob (preference_accuracy) and the mean of chosen minus rejected
    summed log-probs (preference_margin)."""
    from finetune.train.preference import eval_totals

    device = model_device(model)
    batches = batching.batches(examples, recipe.train.micro_batch_size, 0, False, recipe.data.max_seq_len)
    spec = recipe.train.model_copy(update={"method": "orpo"})  # the reference-free statistics
    totals = eval_totals(model, batches, device.type, spec, recipe.eval.max_batches, device)
    pairs = max(totals.get("pairs", 0.0), 1.0)
    return {"preference_accuracy": totals.get("prefers", 0.0) / pairs,
            "preference_margin": totals.get("logp_margin", 0.0) / pairs}


def _scores(model, tok, prepared, recipe, prefix: str = "", record: list | None = None) -> dict:
    """Held-out loss (of the chosen answers, for pairs), exact match and, for pairs, preference_metrics."""
    n, mnt = recipe.eval.exact_match_samples, recipe.eval.max_new_tokens
    template = encode.chat_template(recipe.data, tok)
    pairs = [e for e in prepared.eval if "rejected_ids" in e]
    chosen = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in prepared.eval]
    res = {"eval_loss": heldout_loss(model, chosen, recipe),
           "exact_match": exact_match(model, tok, prepared.eval_rows, n, mnt, template, record,
                                      encode.chat_layout(recipe.data, tok))}
    if pairs:
        res.update(preference_metrics(model, pairs, recipe))
    return {prefix + k: v for k, v in res.items()}


# `finetune eval`'s default cap on held-out rows: a 100,000-row held-out set would run for many minutes, twice
# (adapter and base), with nothing to show for it but a slightly narrower error bar.
MAX_EVAL_ROWS = 2000


def write_predictions(run_dir: Path, adapter: list, base: list) -> Path:
    """RUN_DIR/predictions.jsonl: each exact-match prompt, its expected answer, the adapter's and the base's."""
    from finetune.util.atomic import write_text

    lines = [json.dumps({"prompt": p, "expected": c, "adapter": o, "base": b, "match": o.strip() == c.strip(),
                         "base_match": b.strip() == c.strip()}, ensure_ascii=False)
             for (p, c, o), (_, _, b) in zip(adapter, base)]
    path = run_dir / "predictions.jsonl"
    write_text(path, "".join(line + "\n" for line in lines))
    return path


def run_eval(run_dir: Path, max_rows: int | None = MAX_EVAL_ROWS) -> dict:
    """The run's adapter against the base on the held-out rows (the first `max_rows`; None or 0: all); a run
    that started from an adapter (lora.init_adapter, e.g. DPO after SFT) is also scored with that starting
    adapter (start_*)."""
    from finetune.util.log import log

    recipe, tok, model = load_run(run_dir)
    prepared = prepare(recipe.data, tok, vocab_size(recipe.model.name))
    if not prepared.eval:
        raise RecipeError(["data: no held-out rows; set data.eval_sources or data.eval_split > 0"])
    if max_rows and len(prepared.eval) > max_rows:
        log.info(f"eval: scoring the first {max_rows} of {len(prepared.eval)} held-out rows (--max-rows N for "
                 "more, --max-rows 0 for all)")
        prepared.eval, prepared.eval_rows = prepared.eval[:max_rows], prepared.eval_rows[:max_rows]
    adapter, base = [], []
    res = _scores(model, tok, prepared, recipe, record=adapter)
    with model.disable_adapter():
        res.update(_scores(model, tok, prepared, recipe, "base_", record=base))
    if adapter:
        res["predictions"] = str(write_predictions(Path(run_dir), adapter, base))
    start = recipe.lora.init_adapter
    if start and (Path(start) / "adapter_model.safetensors").exists():
        model.load_adapter(start, adapter_name="start")
        model.set_adapter("start")
        res.update(_scores(model, tok, prepared, recipe, "start_"))
        model.set_adapter("default")
    res["eval_rows"] = len(prepared.eval)
    res["perplexity"] = float(torch.exp(torch.tensor(res["eval_loss"])))
    return res
