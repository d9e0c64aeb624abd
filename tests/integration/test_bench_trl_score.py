"""Row 7's scorer (benchmarks/peers/trl_sft.py `score`) on a real adapter: every arm's adapter is scored by
finetune's own eval code, so a change there must not break the row silently."""
import pytest

from benchmarks.peers import trl_sft
from benchmarks.common import TINY_RECIPE
from finetune import recipe as recipe_mod

pytestmark = pytest.mark.slow


def test_every_arm_is_scored_by_finetunes_eval(tmp_path):
    """`score` (the one scorer of every arm's adapter) on a fresh adapter: LoRA B is zero, so the held-out
    loss is the base model's, as `finetune eval` computes it for the base."""
    import torch

    from finetune.data.prepare import prepare
    from finetune.train.precision import resolve_cpu_precision
    from finetune.train.inference import heldout_loss
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model
    from finetune.weights.load.resolve import load_tokenizer

    # the scorer's path, not its length: 32 held-out rows, 4 of them generated
    few = ("eval.exact_match_samples=4", "eval.max_new_tokens=8",
           "data.eval_sources=[{path: 'builtin:tiny-instruct', split: eval, max_samples: 32}]")
    rec = recipe_mod.load(TINY_RECIPE, [*trl_sft.overrides(1, 4, 2), *few])
    fresh = apply_lora(load_model(rec.model, rec.quantization, quiet=True), rec.lora, seed=1)
    fresh.save_pretrained(tmp_path / "adapter")
    got = trl_sft.score(str(tmp_path / "adapter"), 1, 4, 2, few)
    scored, _ = resolve_cpu_precision(rec, on_cpu=not torch.cuda.is_available())  # as score's eval does
    base = load_model(scored.model, scored.quantization, quiet=True).eval()
    with torch.no_grad():
        want = heldout_loss(base, prepare(rec.data, load_tokenizer(rec.model)).eval, scored)
    assert abs(got["eval_loss"] - want) < 2e-3 * want
    assert got["exact_match"] is not None and 0.0 <= got["exact_match"] <= 1.0
