"""`finetune generate RUN_DIR --prompt TEXT`: greedy text from a run's adapter (or its base alone)."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample from the trained adapter",
                       description="Greedy text from a run's adapter, one JSON line per prompt.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--prompt", action="append", required=True, help="may be given several times")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--no-adapter", action="store_true", help="the base model alone, for comparison")
    p.set_defaults(run=run)


def run(args) -> int:
    import contextlib
    import json

    from finetune.train.evaluate import greedy, load_run

    recipe, tok, model = load_run(args.run_dir)
    mnt = args.max_new_tokens or recipe.eval.max_new_tokens
    prompts = [p.encode().decode("unicode_escape") for p in args.prompt]  # allow "\n" on the command line
    with model.disable_adapter() if args.no_adapter else contextlib.nullcontext():
        outs = greedy(model, tok, prompts, mnt)
    for p, o in zip(prompts, outs):
        print(json.dumps({"prompt": p, "output": o}))
    return 0
