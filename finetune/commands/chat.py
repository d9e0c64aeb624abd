"""`finetune chat RUN_DIR`: an interactive multi-turn session on a run's adapter (or merged model, or base alone).

Each turn is `generate --messages` on the conversation so far: the same loading, argument checks, chat template
and stop tokens (commands/generate.py, train/inference.py), so what chat answers is what generate answers for
the same messages. Lines come from stdin, a terminal or a script; `/reset` clears the history, `/exit` or end of
input ends the session. The history is bounded by the model's context: the oldest turns are dropped, with a note.
"""
from __future__ import annotations

import sys
from pathlib import Path

from finetune.commands.generate import add_model_arguments, as_text, check_arguments


def register(sub) -> None:
    p = sub.add_parser("chat", help="an interactive multi-turn session with the trained adapter",
                       description="Chat with a run's adapter (or merged model, or base alone), each turn rendered "
                                   "with the run's chat template exactly as `generate --messages` renders it. One "
                                   "user turn per line of stdin; /reset clears the history, /exit or EOF ends.")
    p.add_argument("run_dir", type=Path, help="run dir (recipe.yaml + adapter/), or with --merged a merged model dir")
    p.add_argument("--system", help="a system message at the start of the conversation")
    add_model_arguments(p)
    p.set_defaults(run=run)


def fit(model, tok, system: list, history: list, template: str, max_new_tokens: int) -> int:
    """Drop the oldest user/assistant pairs of `history` until system + history + the answer fit the model's
    context; returns how many were dropped. ContextOverflow when the newest user turn alone does not fit."""
    from finetune.train.inference import ContextOverflow, check_context

    dropped = 0
    while True:
        try:
            check_context(model, tok, [system + history], template, max_new_tokens)
            return dropped
        except ContextOverflow:  # only this: a template that fails or loops is reported once, exit 2
            if len(history) < 3:  # only the new turn is left: it is the one too long
                raise
            del history[:2]  # history is user, assistant, ..., user: keep it alternating
            dropped += 1


def _lines():
    """The user's lines as text, until end of input or Ctrl-C; a line that is not UTF-8 is exit 2 naming it."""
    if hasattr(sys.stdin, "reconfigure"):  # a byte that is not text is named by its line, not a traceback
        sys.stdin.reconfigure(errors="surrogateescape")
    tty = sys.stdin.isatty()
    if tty:
        print("chat: one message per line; /reset clears the history, /exit or Ctrl-D ends", file=sys.stderr)
    number = 0
    while True:
        try:
            line = input("you> " if tty else "")
        except EOFError:
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt ends the session like /exit, not with a traceback
            print(file=sys.stderr)
            return
        number += 1
        yield as_text(line, f"input line {number}")


def run(args) -> int:
    import contextlib

    from finetune.util.errors import RecipeError

    args.prompt = []  # generate's checks, which also look at its --prompt
    check_arguments(args)
    from finetune.data.encode import chat_template  # torch only after the arguments and the run dir passed
    from finetune.data.template import check_system
    from finetune.train.inference import ContextOverflow, generate, load_run

    recipe, tok, model = load_run(args.run_dir, merged=args.merged)
    template = chat_template(recipe.data, tok) if recipe is not None else tok.chat_template
    if not template:
        raise RecipeError([f"chat: {args.run_dir}: the tokenizer has no chat template and the recipe sets no "
                           "data.chat_template; use `finetune generate --prompt` for plain text"])
    if args.system:
        check_system(tok, template)  # before the first line is read, not a traceback at every line
    mnt = args.max_new_tokens or (recipe.eval.max_new_tokens if recipe is not None else 64)
    system = [{"role": "system", "content": args.system}] if args.system else []
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else None
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)
    history: list[dict] = []
    for line in _lines():
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            history.clear()
            print("chat: history cleared", file=sys.stderr)
            continue
        if not text:
            continue
        history.append({"role": "user", "content": line})
        try:
            dropped = fit(model, tok, system, history, template, mnt)
        except ContextOverflow:  # this one message is too long: say so and let the session go on
            history.pop()
            print(f"chat: this message and an answer of --max-new-tokens {mnt} do not fit the model's context of "
                  f"{model.config.max_position_embeddings} tokens; shorten it or lower --max-new-tokens",
                  file=sys.stderr)
            continue
        if dropped:
            print(f"chat: dropped the oldest {dropped} turn(s) to fit the model's context of "
                  f"{model.config.max_position_embeddings} tokens", file=sys.stderr)
        with model.disable_adapter() if args.no_adapter else contextlib.nullcontext():
            answer = generate(model, tok, [system + history], template, mnt, sampling)[0]
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
    return 0

