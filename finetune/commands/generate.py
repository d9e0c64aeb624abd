"""`finetune generate RUN_DIR --prompt TEXT`: text from a run's adapter, its merged model or its base alone,
greedy or sampled, prompted the way training rendered its rows (the chat template for chat data)."""
from __future__ import annotations

import argparse
from pathlib import Path


# What a shell cannot type inside one argument. Only these: "unicode_escape" would also decode the UTF-8
# bytes of every non-ASCII character as Latin-1 ("café" -> "cafÃ©").
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def decode_escapes(text: str) -> str:
    """\\n, \\t, \\r and \\\\ in a command-line prompt as the characters they name; everything else as typed."""
    import re

    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m[1]], text)


def register(sub) -> None:
    p = sub.add_parser("generate", help="greedy or sampled text from the trained adapter",
                       description="Text from a run's adapter (or merged model, or base alone), one JSON line per "
                                   "prompt. When the recipe trains chat data (or with --chat) each prompt is a user "
                                   "turn rendered with the run's chat template up to the assistant's turn, exactly "
                                   "as training rendered it. Greedy unless --temperature > 0.")
    p.add_argument("run_dir", type=Path, help="run dir (recipe.yaml + adapter/), or with --merged a merged model dir")
    p.add_argument("--prompt", action="append", default=[],
                   help="may be given several times; \\n, \\t, \\r and \\\\ are decoded")
    p.add_argument("--instruction", help="an instruction row's instruction, laid out as training lays out "
                                         "instruction rows (with --input)")
    p.add_argument("--input", help="the instruction row's input (with --instruction)")
    p.add_argument("--messages", type=Path, help="a JSON file: a list of chat messages, or {\"messages\": [...], "
                                                 "\"tools\": [...]}; the answer is the next assistant turn")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render each prompt as a user turn with the chat template (default: when the recipe's "
                        "training data are chats)")
    p.add_argument("--system", help="a system message before each chat prompt")
    add_model_arguments(p)
    p.set_defaults(run=run)


def add_model_arguments(p) -> None:
    """What generates and from which model: shared by `generate` and `chat`, checked by `check_arguments`."""
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's eval.max_new_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler, for repeatable samples")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--no-adapter", action="store_true", help="the base model alone, for comparison")
    which.add_argument("--merged", action="store_true",
                       help="the merged model: RUN_DIR/merged (from `finetune merge`) or RUN_DIR itself")


def as_text(value: str, what: str) -> str:
    """`value` as text that can be tokenized. Python hands bytes that are not valid in the locale's encoding
    over as lone surrogates (surrogateescape), which the tokenizer refuses with a TypeError: the bytes are
    decoded as UTF-8 when they are UTF-8 (a strict C locale decoded them as ASCII: lossless), else exit 2
    naming `what` and the first byte that is not UTF-8."""
    import os

    from finetune.util.errors import RecipeError

    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    raw = os.fsencode(value) if what.startswith("--") else value.encode("utf-8", "surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError([f"{what}: not UTF-8 text (byte {raw[e.start]:#04x} at position {e.start}); give the "
                           "text in UTF-8 (e.g. iconv -t UTF-8)"]) from None


def check_arguments(args) -> None:
    """Every numeric argument in range, every prompt non-empty and the run dir a finished run's, before
    anything loads (exit 2); torch-free, so a refusal answers at once."""
    import math

    from finetune.util.errors import RecipeError

    bad = []
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        bad.append(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        bad.append(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        bad.append(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.seed is not None and not 0 <= args.seed < 2 ** 32:
        bad.append(f"--seed must be 0 to 2^32-1, got {args.seed}")
    bad += [f"--prompt #{i + 1} is empty; give the text to continue" for i, p in enumerate(args.prompt) if not p.strip()]
    if bad:
        raise RecipeError(bad)
    args.prompt = [as_text(p, f"--prompt #{i + 1}" if len(args.prompt) > 1 else "--prompt")
                   for i, p in enumerate(args.prompt)]
    for name in ("system", "instruction", "input"):  # chat has only --system
        if getattr(args, name, None) is not None:
            setattr(args, name, as_text(getattr(args, name), f"--{name}"))
    if not args.merged:
        from finetune.train.runcheck import checked_run

        checked_run(args.run_dir)  # damaged or unsafe: one line now, not after the imports


def instruction_rows(args) -> list[dict]:
    """--instruction/--input as an instruction row; training's layout is applied once the recipe is read."""
    from finetune.util.errors import RecipeError

    if args.input is not None and args.instruction is None:
        raise RecipeError(["--input: give --instruction with it"])
    if args.instruction is None:
        if not args.prompt and not args.messages:
            raise RecipeError(["give a prompt: --prompt TEXT, --instruction TEXT [--input TEXT] or --messages FILE"])
        return []
    return [{"instruction": decode_escapes(args.instruction), "input": decode_escapes(args.input or "")}]


def read_messages(path: Path):
    """A multi-turn prompt from a JSON file: a list of messages, or {"messages", "tools"} (as a data row)."""
    import json

    from finetune.util.errors import RecipeError

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RecipeError([f"--messages: {path}: {e}"]) from None
    msgs = value.get("messages") if isinstance(value, dict) else value
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
        raise RecipeError([f"--messages: {path}: expected a list of messages ({{\"role\", \"content\"}}) or "
                           "{\"messages\": [...], \"tools\": [...]}"])
    tools = value.get("tools") if isinstance(value, dict) else None
    return {"messages": msgs, "tools": tools} if tools else msgs


def run(args) -> int:
    import contextlib
    import json

    from finetune.util.errors import RecipeError

    check_arguments(args)
    texts, rows = [decode_escapes(p) for p in args.prompt], instruction_rows(args)  # bad arguments before loading
    conversation = read_messages(args.messages) if args.messages else None
    # torch and transformers only now: a mistyped argument is refused at once, not after seconds of imports
    from finetune.data.encode import chat_template, instruction_prompt, instruction_user
    from finetune.train.inference import check_context, generate, load_run, trains_chat

    recipe, tok, model = load_run(args.run_dir, merged=args.merged)
    chat = args.chat if args.chat is not None else (recipe is not None and trains_chat(recipe, tok))
    template = (chat_template(recipe.data, tok) if recipe is not None else tok.chat_template) if chat else None
    if chat and not template:
        raise RecipeError(["--chat: the tokenizer has no chat template and the recipe sets no data.chat_template"])
    # an instruction row is laid out as training laid it out: a user turn (encode.chat_layout) or raw text
    texts += [instruction_user(r) if chat else instruction_prompt(r) for r in rows]
    mnt = args.max_new_tokens or (recipe.eval.max_new_tokens if recipe is not None else 64)
    if chat and args.system:
        from finetune.data.template import check_system

        check_system(tok, template)  # Gemma- and Mistral-style templates raise on a system turn
    system = [{"role": "system", "content": args.system}] if args.system else []
    prompts = [system + [{"role": "user", "content": t}] for t in texts] if chat else list(texts)
    if conversation is not None:
        template = template or (chat_template(recipe.data, tok) if recipe is not None else tok.chat_template)
        if not template:
            raise RecipeError(["--messages: the tokenizer has no chat template and the recipe sets no data.chat_template"])
        prompts.append(conversation)
        texts.append(conversation)
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else None
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)
    check_context(model, tok, prompts, template, mnt)  # bounded by the model's context, not by time
    with model.disable_adapter() if args.no_adapter else contextlib.nullcontext():
        outs = generate(model, tok, prompts, template, mnt, sampling)
    for t, o in zip(texts, outs):
        print(json.dumps({"prompt": t, "output": o}))
    return 0
