"""Every model family the architecture table names, end to end on a tiny synthetic copy (the real
transformers class, 2 layers, hidden 64, seeded random weights; tests/integration/families.py):

- one process: train 2 steps through the real loop (streaming 4-bit loader, LoRA, the chunked loss),
  merge at fp32 with the parity check, and reload the adapter in plain peft, whose logits equal the
  merged model's; tied heads stay tied; on MoE families the fused expert weights carry adapters that
  training moved, and the merge changes every expert;
- two FSDP2 processes (one torchrun launch for all families, families_worker.py): train 2 steps, save,
  then resume to step 3; the saved adapter reloads in plain peft with full shapes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ..conftest import warm_launch
from .families import FAMILIES, ROOT, model_name, overrides

pytestmark = pytest.mark.slow


def _train(run_dir, family):
    from finetune.recipe import load
    from finetune.train.loop import train

    return train(load(ROOT / "recipes" / "tiny_cpu.yaml", overrides(family, run_dir, 2)), run_dir)


def _plain_peft(run_dir, adapter_dir=None):
    """The base in fp32 from its directory and the saved adapter through plain peft, no finetune code."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.weights.load.resolve import resolve_name  # the portable name (synthetic:...) -> its directory here

    base_dir = resolve_name(json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"])
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir or run_dir / "adapter")).eval(), base_dir


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _expert_keys(tensors: dict) -> list[str]:
    return sorted(k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj")))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_merges_and_reloads(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.merge.stream import merge

    run_dir = tmp_path / "run"
    result = _train(run_dir, family)
    assert result["step"] == 2 and torch.isfinite(torch.tensor(result["loss"]))
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert adapter and all(v.abs().sum() > 0 for k, v in adapter.items() if ".lora_B." in k)  # B starts at 0

    out = merge(run_dir, dtype="fp32")
    parity = json.loads((out / "merge_info.json").read_text())["parity"]
    assert parity["status"] == "passed" and parity["kind"] == "logits" and parity["tolerance"] == 1e-4, parity

    peft_model, base_dir = _plain_peft(run_dir)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(merged, ids), _logits(peft_model, ids), rtol=1e-4, atol=1e-4)
    if FAMILIES[family][3]:  # tied: one table, in the trained model's reload and in the merged model
        inner = peft_model.get_base_model()
        assert inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
        assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    if FAMILIES[family][4]:
        _check_experts(run_dir, adapter, base_dir, out)


def _check_experts(run_dir, adapter, base_dir, out):
    """MoE: both fused expert parameters of every layer carry a trained adapter (the router none), and
    the merge moved every expert of them."""
    from finetune.merge.source import base_tensors

    config = (run_dir / "adapter" / "adapter_config.json").read_text()
    assert '"experts.gate_up_proj"' in config and "gate.weight" not in config
    assert not any(".mlp.gate." in k for k in adapter)  # the router stays frozen: no adapter on it
    wrapped = [k for k in adapter if ".experts." in k and k.endswith("lora_B.weight")]
    assert len(wrapped) == 2 * 2  # 2 layers x (gate_up_proj, down_proj)
    base = {}
    for t in base_tensors(Path(base_dir)):
        if t.name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base.update({t.name: load_file(os.path.join(base_dir, t.source))[t.name]})
    merged = {}
    for f in out.glob("*.safetensors"):
        merged.update({k: v for k, v in load_file(f).items() if k in base})
    assert sorted(merged) == sorted(base) and len(base) == 4
    for name, w in base.items():
        moved = (merged[name] - w.float()).abs().amax(dim=(1, 2))  # per expert
        assert (moved > 0).all(), f"{name}: experts {(moved == 0).nonzero().flatten().tolist()} unchanged by merge"


def test_families_train_and_resume_under_fsdp2(tmp_path):
    """One torchrun launch, two processes, every family: train 2 steps, checkpoint, resume to 3."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "integration" / "families_worker.py"), str(tmp_path), *FAMILIES]
    cmd, env = warm_launch(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    for family, spec in FAMILIES.items():
        facts = json.loads((tmp_path / f"{family}.json").read_text())
        assert facts["step_after_2"] == 2 and facts["step_after_3"] == 3, (family, facts)
        run_dir = tmp_path / family
        # The second run resumed from step 2 and trained step 3 only: it did not start over.
        assert len(facts["resumed_3"]) == 1 and facts["resumed_3"][0].endswith("step-2 (step 2)"), (family, facts)
        assert facts["trained_2"] == [1, 2] and facts["trained_3"] == [3], (family, facts)
        if spec[3]:
            assert facts["tied_after_2"] and facts["tied_after_3"], (family, facts)
        model, _ = _plain_peft(run_dir)  # gathered full shapes: a rank's shard would not load
        assert model_name(family).startswith("synthetic:")
        saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
        loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        assert len(saved) == len(loaded) and saved


def test_gemma3_text_decoder_loads_from_an_image_text_checkpoint(tmp_path):
    """Gemma 3 4B-27B ship as image-text checkpoints (`language_model.model.*` keys, a `gemma3` config
    with a text_config): the loader builds the text decoder alone and finds its tensors there."""
    import shutil

    from safetensors.torch import save_file

    from finetune.recipe import ModelSpec, QuantizationSpec
    from finetune.weights.load.model import load_model
    from finetune.weights.built.synthetic import synthetic_dir

    text_dir = synthetic_dir(model_name("gemma3"))
    text_cfg = json.loads((text_dir / "config.json").read_text())
    weights = {}
    for f in text_dir.glob("*.safetensors"):
        weights.update({"language_model." + k: v for k, v in load_file(f).items()})
    mm = tmp_path / "gemma3-mm"
    mm.mkdir()
    save_file(weights, str(mm / "model.safetensors"), metadata={"format": "pt"})
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma3", "architectures": [
        "Gemma3ForConditionalGeneration"], "text_config": text_cfg, "tie_word_embeddings": True}))
    for f in text_dir.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, mm / f.name)
    model = load_model(ModelSpec(name=str(mm), dtype="bfloat16"), QuantizationSpec(mode="none"), quiet=True)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    emb = weights["language_model.model.embed_tokens.weight"]
    assert torch.equal(model.get_input_embeddings().weight, emb)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
