"""`finetune export --format gguf` of an MoE run (only where scripts/setup.sh fetched llama.cpp's converter):
synthetic Qwen3-MoE and Mixtral in the hub's per-expert layout (2 layers, 16 experts; moe4bit.py), trained
2 steps with every expert adapted, then exported (which merges first). llama.cpp's converter stacks each
layer's experts into blk.N.ffn_{gate,up,down}_exps; the export's read-back must map those back to the
merged per-expert weights (gguf/stacked_experts.py) and pass, each stacked GGUF tensor must equal the merged
experts stacked in expert order, and the merge must have moved the experts (so the equality is with the adapted weights). A
read-back of merged weights with two experts swapped must fail: the check compares experts, not just names. A
fused 3-D checkpoint (transformers 5) reads back too; `--adapter-only` of expert adapters is refused (exit 2).
"""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from finetune import cli
from finetune.gguf import converter

from .families import ROOT
from .moe4bit import EXPERTS, hub_layout

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (converter.converter_dir() / "convert_hf_to_gguf.py").is_file(),
    reason=f"llama.cpp's converter is not fetched ({converter.converter_dir()}); `{converter.FETCH_COMMAND}`")]
# per-expert projection in the hub's names -> llama.cpp's stacked tensor
PROJS = {"qwen3moe": {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"},
         "mixtral": {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}}


@pytest.fixture(scope="module", params=list(PROJS))
def exported(request, tmp_path_factory):
    """(family, base dir, run dir, report) of a 2-step run exported at f32."""
    from finetune.recipe import load
    from finetune.train.loop import train

    family = request.param
    root = tmp_path_factory.mktemp(family)
    base = hub_layout(family, root / "model")
    run_dir = root / "run"
    recipe = load(ROOT / "recipes" / "tiny_cpu.yaml", [
        f"model.name={base}", "train.max_steps=2", "train.warmup_steps=0", "train.log_every=1",
        "data.max_samples=16", "data.max_seq_len=32", "output.progress_bar=false", "data.eval_sources=[]",
        "data.eval_split=0", "lora.dropout=0", "train.learning_rate=1e-2", f"output.dir={run_dir}"])
    train(recipe, run_dir)
    assert cli.main(["export", str(run_dir), "--format", "gguf", "--outtype", "f32", "--greedy-prompts", "0"]) == 0
    report = json.loads((run_dir / "gguf" / "model-f32.gguf.json").read_text())
    return family, base, run_dir, report


def _per_expert(directory) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _stacked(weights: dict, family: str) -> dict[str, torch.Tensor]:
    """'blk.L.ffn_X_exps' -> the merged experts of layer L stacked in expert order [E, rows, cols]."""
    pat = re.compile(r"^model\.layers\.(\d+)\..*\.experts\.(\d+)\.([^.]+)\.weight$")
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in weights.items():
        m = pat.match(k)
        if m:
            groups.setdefault(f"blk.{m[1]}.{PROJS[family][m[3]]}", {})[int(m[2])] = v
    return {k: torch.stack([g[e] for e in range(EXPERTS)]).float() for k, g in groups.items()}


def test_moe_export_reads_back_and_its_expert_tensors_equal_the_merged_experts(exported):
    from finetune.gguf.readback import gguf_module, read_tensor

    family, base, run_dir, report = exported
    t = report["tensors"]
    assert t["mismatched"] == [] and t["checked"] == t["tensors"] and t["max_abs_diff"] == {"F32": 0.0}, t
    merged = _stacked(_per_expert(run_dir / "merged"), family)
    original = _stacked(_per_expert(base), family)
    assert len(merged) == 2 * 3  # 2 layers x (gate, up, down)
    gguf = gguf_module(converter.converter_dir())
    tensors = {x.name: x for x in gguf.GGUFReader(str(run_dir / "gguf" / "model-f32.gguf")).tensors}
    for name, want in merged.items():
        got = read_tensor(gguf, tensors[f"{name}.weight"])
        assert got.shape == (EXPERTS, *want.shape[1:]) and torch.equal(got, want), name
        moved = (want - original[name]).abs().amax(dim=(1, 2))
        assert (moved > 0).all(), f"{name}: experts {(moved == 0).nonzero().flatten().tolist()} not moved by merge"


def test_readback_fails_when_two_experts_are_swapped(exported):
    from finetune.gguf.readback import check_tensors

    family, _, run_dir, _ = exported
    weights = _per_expert(run_dir / "merged")
    down = next(p for p, g in PROJS[family].items() if g == "ffn_down_exps")
    stem = next(k for k in weights if k.endswith(f".experts.0.{down}.weight")).split(".experts.")[0]
    first, second = f"{stem}.experts.0.{down}.weight", f"{stem}.experts.1.{down}.weight"
    weights[first], weights[second] = weights[second], weights[first]
    config = json.loads((run_dir / "merged" / "config.json").read_text())
    res = check_tensors(converter.converter_dir(), run_dir / "gguf" / "model-f32.gguf", weights, config)
    assert len(res["mismatched"]) == 1 and "blk.0.ffn_down_exps.weight" in res["mismatched"][0], res["mismatched"]
    assert f"{EXPERTS} experts" in res["mismatched"][0]


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_fused_experts_of_a_transformers_5_checkpoint_read_back(outtype, tmp_path, capsys):
    """A merged model whose experts are fused 3-D (what transformers 5 saves: experts.gate_up_proj [E, 2i, h],
    experts.down_proj [E, h, i]; the synthetic Qwen3-MoE as built): the converter splits gate_up_proj at half
    its rows, and the read-back compares both halves and down_proj within the type's tolerance."""
    from finetune.weights.built.synthetic import synthetic_dir

    from .moe4bit import BASES, SMALL

    base, extra = BASES["qwen3moe"]
    model = synthetic_dir(f"synthetic:{base}{SMALL}{extra}")
    assert any(k.endswith("experts.gate_up_proj") for k in _per_expert(model))  # fused, not per expert
    out = tmp_path / f"m-{outtype}.gguf"
    assert cli.main(["export", str(tmp_path / "none"), "--merged", str(model), "--output", str(out),
                     "--outtype", outtype, "--greedy-prompts", "0"]) == 0, capsys.readouterr().err
    t = json.loads(out.with_name(out.name + ".json").read_text())["tensors"]
    assert t["mismatched"] == [] and t["checked"] == t["tensors"] == 27, t  # 2 layers x (9 + router + 3 stacked experts) + 3


def test_adapter_only_export_of_expert_adapters_is_refused_in_one_line(exported, capsys):
    """llama.cpp's LoRA converter stops on peft's expert adapters ('Unprocessed experts'); export says so first."""
    run_dir = exported[2]
    assert cli.main(["export", str(run_dir), "--adapter-only", "--outtype", "f32"]) == 2
    err = capsys.readouterr().err
    assert "--adapter-only" in err and "MoE experts" in err and "Traceback" not in err
    assert not (run_dir / "gguf" / "adapter-f32.gguf").exists()
