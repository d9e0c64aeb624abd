"""Pre-quantized 4-bit checkpoints: the base quantized once and written in the format of the `*-bnb-4bit`
repositories (packed weights plus each layer's quantization state in the safetensors, the
BitsAndBytesConfig in config.json), which the streaming loader then reads without quantizing again.
The writing is transformers' own (`save_pretrained` of a bitsandbytes 4-bit model)."""
from __future__ import annotations

from pathlib import Path

from finetune.recipe import ModelSpec, QuantizationSpec
from finetune.util.errors import OutputWriteError, RecipeError, reason


def write_prequantized(spec: ModelSpec, quant: QuantizationSpec, out: Path) -> Path:
    """Quantize `spec`'s base per `quant` (one process, streamed) and write it with its tokenizer to `out`."""
    from finetune.weights.load.model import load_model
    from finetune.weights.load.resolve import load_tokenizer

    if quant.mode not in ("nf4", "fp4"):
        raise RecipeError([f"quantization.mode: {quant.mode}: only 4-bit (nf4, fp4) bases are written pre-quantized"])
    from safetensors import SafetensorError

    from finetune.util.sibling import apply_umask, carried_oserror, clean_stale, temp_dir

    model = load_model(spec, quant, quiet=True)
    clean_stale(out, "quantize")  # what a quantize killed mid-write left beside `out`
    # Written beside (hidden, locked), renamed when complete: a failed write leaves no half checkpoint at `out`.
    try:
        with temp_dir(out) as tmp:
            try:
                model.save_pretrained(tmp, safe_serialization=True)
            except SafetensorError as e:
                raise (carried_oserror(e, tmp) or e) from None
            load_tokenizer(spec).save_pretrained(tmp)
            apply_umask(tmp)  # readable as the umask says, like merge's output (mkdtemp makes 0700)
            tmp.rename(out)
    except OSError as e:  # disk full, quota, read-only: one line (exit 1), the temporary already removed
        raise OutputWriteError(e.errno, f"quantize: writing {out} failed: {reason(e)}; nothing was written there. "
                                        "Free space (or choose another --output) and run it again") from None
    return out
