"""`finetune eval RUN_DIR [--json]`: held-out loss and exact match of a finished run, adapter against base."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("eval", help="held-out loss and exact match, adapter vs base",
                       description="Held-out loss and exact match of a run.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--max-rows", type=int, default=2000,
                   help="score at most this many held-out rows (default 2000, said when it applies; 0: all)")
    p.add_argument("--show", type=int, default=0, metavar="N",
                   help="print N of the predictions (RUN_DIR/predictions.jsonl: prompt, expected, adapter, base)")
    p.set_defaults(run=run)


def run(args) -> int:
    import json

    from finetune.util.errors import RecipeError

    if args.max_rows < 0:
        raise RecipeError([f"--max-rows must be >= 0, got {args.max_rows}"])
    if args.show < 0:
        raise RecipeError([f"--show must be >= 0, got {args.show}"])
    from finetune.train.runcheck import checked_run

    checked_run(args.run_dir)  # a damaged or unsafe run dir too
    from finetune.recipe.rundir import planted_links

    if links := planted_links(args.run_dir):  # predictions.jsonl and its temporary: before any scoring
        raise RecipeError(links)
    from finetune.train.inference import run_eval  # torch only after the arguments and the run dir passed

    res = run_eval(args.run_dir, args.max_rows)
    for k, v in res.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {'n/a' if v is None else v}")
    if any(v is None for k, v in res.items() if k.endswith("exact_match")):
        print("exact match n/a: no held-out row has a prompt and an answer to compare (text or token rows)")
    if args.show and res.get("predictions"):
        rows = [json.loads(line) for line in Path(res["predictions"]).read_text().splitlines()]
        for i, r in enumerate(rows[: args.show]):
            print(f"--- prediction {i + 1} of {len(rows)}")
            prompt = r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"], ensure_ascii=False)
            print(f"prompt:   {prompt!r}\nexpected: {r['expected']!r}\nadapter:  {r['adapter']!r}"
                  f"{' (match)' if r['match'] else ''}\nbase:     {r['base']!r}{' (match)' if r['base_match'] else ''}")
    if args.json:
        print(json.dumps(res))
    return 0
