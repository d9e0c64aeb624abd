"""`finetune merge RUN_DIR [--output DIR] [--target original|nf4]`: fold the LoRA adapter into its base,
streaming one shard at a time, with a logits parity check before the output appears."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("merge", help="fold the adapter into the base (streaming)",
                       description="Fold a LoRA adapter into its base and write one servable model.")
    p.add_argument("run_dir", help="run dir (recipe.yaml + adapter/) or a PEFT adapter directory")
    p.add_argument("--output", help="output directory (default: RUN_DIR/merged)")
    p.add_argument("--target", choices=["original", "nf4"], default="original",
                   help="merge into the original base weights, or into the NF4-dequantized weights training saw")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="dtype of the written weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard, e.g. 5GB, 500MB")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the logits parity check")
    p.set_defaults(run=run)


def run(args) -> int:
    import sys

    from finetune.merge.stream import merge

    try:
        merge(args.run_dir, args.output, args.target, args.dtype, args.max_shard_size, args.force, args.check)
    except RuntimeError as e:  # a failed parity check: nothing was written
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
