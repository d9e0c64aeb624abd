"""Pre-quantized 4-bit checkpoints: the base quantized once and written in the format of the `*-bnb-4bit`
repositories (packed weights plus each layer's quantization state in the safetensors, the
BitsAndBytesConfig in config.json), which the streaming loader then reads without quantizing again.
The writing is transformers' own (`save_pretrained` of a bitsandbytes 4-bit model)."""
from __future__ import annotations

from pathlib import Path

from finetune.recipe import ModelSpec, QuantizationSpec
from finetune.util.errors import RecipeError


def write_prequantized(spec: ModelSpec, quant: QuantizationSpec, out: Path) -> Path:
    """Quantize `spec`'s base per `quant` (one process, streamed) and write it with its tokenizer to `out`."""
    from finetune.weights.model import load_model
    from finetune.weights.resolve import load_tokenizer

    if quant.mode not in ("nf4", "fp4"):
        raise RecipeError([f"quantization.mode: {quant.mode}: only 4-bit (nf4, fp4) bases are written pre-quantized"])
    import shutil
    import tempfile

    model = load_model(spec, quant, quiet=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:  # written beside, renamed when complete: a failed write leaves no half checkpoint at `out`
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(spec).save_pretrained(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
