import os
from pathlib import Path

import pytest
import torch
import yaml


def make_run_dir(root: Path, recipe: dict | None = None, quantize: bool = False, seed: int = 0,
                 lora_kwargs: dict | None = None) -> Path:
    """A run dir as training writes it: recipe.yaml + adapter/ (peft save_pretrained + tokenizer).

    The LoRA is real peft (all-linear, r=16) with lora_B perturbed to non-zero values so the merge is
    not a no-op. quantize=True builds it on the 4-bit model, as QLoRA/FSDP training does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from finetune import recipe as recipe_mod
    from finetune.util import builtin as tiny

    base = tiny.model_dir()
    r = recipe_mod.from_dict(recipe or {})
    kw = {}
    if quantize:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=r.quantization.mode,
            bnb_4bit_use_double_quant=r.quantization.double_quant, bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=getattr(torch, r.effective_quant_storage()))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, r.model.dtype), **kw)
    cfg = LoraConfig(r=r.lora.r, lora_alpha=r.lora.alpha, target_modules="all-linear", lora_dropout=0.0,
                     task_type="CAUSAL_LM", **(lora_kwargs or {}))
    torch.manual_seed(seed)  # LoRA A's init draws from the global generator: fix it, whatever ran before
    model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zero at init; give it values of a trained adapter's size
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    run = root / "run"
    (run / "adapter").mkdir(parents=True)
    model.save_pretrained(run / "adapter")
    AutoTokenizer.from_pretrained(base).save_pretrained(run / "adapter")
    (run / "recipe.yaml").write_text(yaml.safe_dump(r.model_dump(mode="json"), sort_keys=False))
    return run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    return make_run_dir(tmp_path_factory.mktemp("merge-run"))


@pytest.fixture(scope="session")
def qlora_run(tmp_path_factory):
    """Adapter saved by plain peft from a model that was 4-bit during training (what FSDP runs write)."""
    return make_run_dir(tmp_path_factory.mktemp("merge-qrun"), quantize=True, seed=1)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A finished run dir of the tiny recipe as `finetune` writes it: 3 steps, a checkpoint after each (one
    run per test run, shared by the workers; tests that change it take the `run` fixture's copy)."""
    from tests.conftest import once_per_run, run_cli

    def build(root):
        p = run_cli(["recipes/tiny_cpu.yaml", "train.max_steps=3", "train.warmup_steps=0", "train.save_every=1",
                     "train.keep_checkpoints=3", f"output.dir={root / 'run'}"])
        assert p.returncode == 0, p.stderr

    return once_per_run(tmp_path_factory, "trained-run", build) / "run"


@pytest.fixture(scope="session")
def embedded_default(tmp_path_factory):
    """The README's first command, once per test run, on an empty cache as on a fresh clone: train
    recipes/tiny_cpu.yaml as it ships (its progress bar off), then `finetune eval RUN_DIR --json`. Returns {"run": the run dir, "train"/"eval": {"returncode",
    "stdout", "stderr"}}; the tests that read it check the return codes themselves."""
    import json

    from tests.conftest import once_per_run, run_cli

    def build(root):
        run, fresh = root / "tiny_cpu", {"FINETUNE_CACHE": str(root / "cache")}  # a fresh clone's empty cache
        # fresh interpreters, as a user's first commands start: their stderr is checked for library noise
        trained = run_cli(["recipes/tiny_cpu.yaml", f"output.dir={run}", "output.progress_bar=false"], timeout=1500,
                          env=fresh, fresh=True)
        scored = run_cli(["eval", str(run), "--json"], env=fresh, fresh=True) if trained.returncode == 0 else trained
        (root / "commands.json").write_text(json.dumps(
            {name: {"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
             for name, p in (("train", trained), ("eval", scored))}))

    root = once_per_run(tmp_path_factory, "embedded-default", build)
    return {"run": root / "tiny_cpu", **json.loads((root / "commands.json").read_text())}


@pytest.fixture
def run(trained_run, tmp_path):
    """A copy of `trained_run` that a test may damage."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    return copy


PHASE_SETTINGS = {"threads": 1, "together": True, "eval_batches": 1}  # test_phase_memory.py says why
# The synthetic Llama the phase-memory test measures: benchmarks.cpu.phase_rss's model at 10 of its 16 layers
# (1.7 GB in bf16). Measured on 2 cores, 2026-11-28: 220 core-seconds against 432 at 16 layers (each of the
# three runs quantizes the whole model), plan errors within 15% (16 layers: 18%), savings 0.54x / 0.57x of
# the packed bytes (0.53x-0.61x), and the closest per-phase margin, FSDP1's save below the one process's,
# 0.044 GiB (0.089 at 16 layers; 0.029 at 8, too close for a test that must not flake).
PHASE_BIG_LAYERS = 10


@pytest.fixture(scope="session")
def phase_memory_big(tmp_path_factory):
    """benchmarks/cpu/phase_rss.py on the synthetic Llama of PHASE_BIG_LAYERS layers (one process, FSDP2 and
    FSDP1 side by side: about 2 minutes), once per test run; test_phase_memory.py reads its result."""
    import json

    from tests.conftest import once_per_run

    def build(root):
        from benchmarks.cpu import phase_rss

        (root / "result.json").write_text(json.dumps(phase_rss.run(layers=PHASE_BIG_LAYERS, **PHASE_SETTINGS)))

    return json.loads((once_per_run(tmp_path_factory, "phase-memory-big", build) / "result.json").read_text())


@pytest.fixture(scope="session", autouse=True)
def _longest_first(request):
    """The two longest runs are built before anything else when a collected test needs them, each by one
    worker while the other goes on: the embedded default (~2 minutes on one thread) on gw1, the big
    phase-memory runs (~2 minutes) on gw0. xdist's loadscope hands out modules by their number of tests,
    largest first, so their small modules came last and each was the suite's tail."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    wanted = set().union(*(getattr(item, "fixturenames", ()) for item in request.session.items))
    for name, on in (("embedded_default", ("gw1", "")), ("phase_memory_big", ("gw0", ""))):
        if worker in on and name in wanted:
            request.getfixturevalue(name)


def nonzero_adapters(model, std: float = 0.05):
    """Every lora_B drawn (peft starts it at zero), so every LoRA tensor gets a gradient."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return model


def tiny_lora_fp32(tiny_model_dir):
    """The builtin tiny model, 4-bit with fp32 dequantization, LoRA r=8 without dropout, adapters non-zero."""
    from finetune.recipe import LoraSpec, ModelSpec, QuantizationSpec
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model

    model = load_model(ModelSpec(name=str(tiny_model_dir), gradient_checkpointing=False),
                       QuantizationSpec(compute_dtype="float32"), quiet=True)
    return nonzero_adapters(apply_lora(model, LoraSpec(r=8, dropout=0.0), seed=0))
