"""`finetune quantize RECIPE --output DIR [key=value ...]`: write the recipe's base pre-quantized (4-bit
packed weights and quantization state in safetensors, the `*-bnb-4bit` format), so later runs with
`model.name: DIR` load it without quantizing again."""
from __future__ import annotations

from pathlib import Path

from finetune.commands.common import add_recipe_arguments, load_recipe


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write the base model pre-quantized (4-bit)",
                       description="Quantize the recipe's base once, per its `quantization` section, and write it "
                                   "in the bitsandbytes 4-bit format transformers reads; set model.name to DIR "
                                   "to train from it without quantizing again.")
    add_recipe_arguments(p)
    p.add_argument("--output", type=Path, required=True, help="directory to write (must not exist)")
    p.set_defaults(run=run)


def run(args) -> int:
    from finetune.weights.built.prequant import write_prequantized
    from finetune.util.errors import RecipeError

    recipe = load_recipe(args)
    if args.output.exists():
        raise RecipeError([f"--output: {args.output} exists; name a new directory"])
    out = write_prequantized(recipe.model, recipe.quantization, args.output)
    print(f"wrote {out} (model.name: {out})")
    return 0
