"""Loading runs no code the recipe did not allow: pickle weights are refused unless `model.allow_pickle`,
a model's own Python code needs `model.trust_remote_code`. Each "evil" file would create a marker
directory when executed; the positive controls show that it really does when allowed."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from finetune import recipe as R
from finetune.train import preflight as V
from finetune.weights.load.model import load_model

pytestmark = pytest.mark.slow


class Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):  # what a malicious checkpoint does: call anything at unpickling time
        return os.mkdir, (self.marker,)


def tiny_llama(path: Path, safetensors: bool = True) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    if safetensors:
        model.save_pretrained(path)
    else:
        cfg.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return {k: v.clone() for k, v in model.state_dict().items()}


def spec(path: Path, **model):
    r = R.from_dict({"model": {"name": str(path), **model}, "quantization": {"mode": "none"}})
    return r.model, r.quantization


def test_pickle_only_weights_are_refused_without_running_them(tmp_path):
    tiny_llama(tmp_path, safetensors=False)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Evil(tmp_path / "pwned")))
    with pytest.raises(R.RecipeError, match="allow_pickle"):
        load_model(*spec(tmp_path))
    assert not (tmp_path / "pwned").exists()
    # Even when allowed, transformers unpickles with torch's weights-only loader, which refuses the call.
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_model(*spec(tmp_path, allow_pickle=True))
    assert not (tmp_path / "pwned").exists()
    pickle.loads((tmp_path / "pytorch_model.bin").read_bytes())  # positive control: plain pickle runs it
    assert (tmp_path / "pwned").is_dir()


def test_allow_pickle_loads_real_pickle_weights(tmp_path):
    saved = tiny_llama(tmp_path, safetensors=False)
    model = load_model(*spec(tmp_path, allow_pickle=True))
    got = model.state_dict()
    assert all(torch.equal(got[k], saved[k]) for k in saved if k in got)


def test_safetensors_are_read_and_a_pickle_beside_them_is_ignored(tmp_path):
    saved = tiny_llama(tmp_path, safetensors=True)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Evil(tmp_path / "pwned")))
    model = load_model(*spec(tmp_path))
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert not (tmp_path / "pwned").exists()


REMOTE_CODE = '''
import os
os.mkdir(MARKER)  # transformers copies this file into its modules cache: the path is absolute
from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    model_type = "evilnet"


class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
'''


def test_remote_code_needs_trust_remote_code(tmp_path):
    tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="evilnet", auto_map={"AutoConfig": "evil.EvilConfig",
                                               "AutoModelForCausalLM": "evil.EvilModel"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "evil.py").write_text(REMOTE_CODE.replace("MARKER", repr(str(tmp_path / "pwned"))))
    r = R.from_dict({"model": {"name": str(tmp_path)}, "output": {"dir": str(tmp_path / "run")}})
    problems = [p for p in V.preflight(r, env={}, launched=False) if p.path == "model.trust_remote_code"]
    assert problems and problems[0].level == "error" and "evil.EvilModel" not in problems[0].message
    assert "AutoModelForCausalLM" in problems[0].message
    with pytest.raises(ValueError, match="trust_remote_code=True"):  # no flag: transformers refuses the import
        load_model(*spec(tmp_path))
    assert not (tmp_path / "pwned").exists()
    trusted = R.from_dict({"model": {"name": str(tmp_path), "trust_remote_code": True},
                           "output": {"dir": str(tmp_path / "run")}})
    assert not [p for p in V.preflight(trusted, env={}, launched=False) if p.path == "model.trust_remote_code"]
    try:  # positive control: with the flag the repository's code runs
        load_model(*spec(tmp_path, trust_remote_code=True))
    except Exception:  # noqa: BLE001 - loading may fail after the import; the import is what we check
        pass
    assert (tmp_path / "pwned").is_dir()


HF = "hf_" + "QwErTyUiOpAsDfGhJkLzXcVbNm12345678"
SECRETS = {"HF_TOKEN": HF, "WANDB_API_KEY": "3f9a1c0d5e7b2468ace013579bdf2468ace01357",
           "FINETUNE_TEST_DB_PASSWORD": "pw-Secret-4711"}


def test_a_planted_secret_reaches_no_log_metric_or_file(tmp_path):
    """Secrets in the environment (where tokens live), and one pasted into a recipe field: a whole run
    (train with checkpoints, final eval, adapter export) writes none of them anywhere: not to its
    stdout/stderr, metrics.jsonl, recipe.yaml, checkpoints, adapter or the data cache."""
    from .procs import fork_cli, wait_pid
    from .test_crash_safety import warm

    warm()
    run, log, cache = tmp_path / "run", tmp_path / "log", tmp_path / "cache"
    argv = ["recipes/tiny_cpu.yaml", "train.max_steps=3", "train.warmup_steps=1", "train.save_every=1",
            "train.micro_batch_size=4", "train.log_every=1", "eval.max_batches=1", "output.progress_bar=false",
            "data.sources=[{path: 'builtin:tiny-instruct', max_samples: 32}]", f"output.dir={run}",
            f"model.revision={HF}"]  # a token pasted where it does not belong (ignored for a local model)
    pid = fork_cli(argv, log, env={**SECRETS, "FINETUNE_CACHE": str(cache)})
    assert wait_pid(pid, 300) == 0, log.read_text()[-3000:]
    written = [p for p in [log, *run.rglob("*"), *cache.rglob("*")] if p.is_file()]
    assert len(written) > 20 and (run / "metrics.jsonl") in written and (run / "recipe.yaml") in written
    for path in written:
        data = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in data, f"{name} found in {path}"
    assert "revision: '***'" in (run / "recipe.yaml").read_text()
