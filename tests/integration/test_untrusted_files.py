"""Files in a run dir that a user or another process could have written are refused (exit 2, one line naming
the file) or set aside (checkpoints: the previous intact step is resumed), never a traceback: a checkpoint
file that is a code-running pickle with a manifest updated to match it, a hand-edited manifest, an empty or
truncated adapter in eval/generate/merge/export, a model config that asks for remote code in generate and
data, a chat template that loops forever in generate --chat."""
import hashlib
import json
import os
import pickle
import shutil

import pytest

from ..conftest import ROOT, run_cli
from .procs import trained_steps

pytestmark = pytest.mark.slow


def _one_line_error(p, code: int, *needles: str):
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in p.stderr, p.stderr[-3000:]


def _rewrite_manifest(step_dir, edit):
    m = json.loads((step_dir / "trainer_state.json").read_text())
    edit(m)
    (step_dir / "trainer_state.json").write_text(json.dumps(m))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_pickle_in_a_checkpoint_is_set_aside_and_the_previous_step_resumed(run, tmp_path):
    marker = str(tmp_path / "code-ran")
    step3 = run / "checkpoints" / "step-3"
    data = pickle.dumps(_RunsCode(marker))
    (step3 / "optimizer-rank0.pt").write_bytes(data)
    # The hashes cover the files, not the manifest: whoever planted the pickle can update the manifest too.
    _rewrite_manifest(step3, lambda m: m["files"].update(
        {"optimizer-rank0.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}))
    p = run_cli([str(run / "recipe.yaml"), f"output.dir={run}", "train.max_steps=4"])
    _one_line_error(p, 0, "not weights-only")
    assert "resume: from" in p.stdout and "step-2 (step 2)" in p.stdout, p.stdout
    assert trained_steps(p.stdout) == [4], p.stdout  # steps 3-4 (log_every 50 prints the last); a restart prints step 1
    assert (run / "checkpoints" / "corrupt-step-3").is_dir() and not os.path.exists(marker)


@pytest.mark.parametrize("edit", [lambda m: m.update(step=1e30), lambda m: m.update(world_size="two"),
                                  lambda m: m.update(data={"cursor": -1}), lambda m: m.update(files=[])],
                         ids=["step-1e30", "world-size-str", "cursor", "files-list"])
def test_a_hand_edited_manifest_is_set_aside(run, edit):
    _rewrite_manifest(run / "checkpoints" / "step-3", edit)
    p = run_cli([str(run / "recipe.yaml"), f"output.dir={run}", "train.max_steps=4"])
    _one_line_error(p, 0, "corrupt-step-3")
    assert "step-2 (step 2)" in p.stdout and "finished: 4 steps" in p.stdout, p.stdout


@pytest.mark.parametrize("size", [0, 5000], ids=["empty", "truncated"])
@pytest.mark.parametrize("verb", ["eval", "generate", "merge", "export"])
def test_a_damaged_adapter_is_one_line(run, verb, size):
    f = run / "adapter" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:size])
    extra = {"generate": ["--prompt", "hi"], "export": ["--greedy-prompts", "0"]}.get(verb, [])
    p = run_cli([verb, str(run), *extra])
    _one_line_error(p, 2, "adapter_model.safetensors", "restore it from the newest checkpoint")


def _remote_code_model(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "finetune" / "util" / "assets" / "tiny-llama-v4", model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}, model_type="evil-llama")
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def test_remote_code_is_refused_by_generate_and_data(run, tmp_path):
    model = _remote_code_model(tmp_path)
    recipe = run / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("name: builtin:tiny-llama", f"name: {model}"))
    p = run_cli(["generate", str(run), "--prompt", "hi"])
    _one_line_error(p, 2, "model.trust_remote_code")
    p = run_cli(["data", "recipes/tiny_cpu.yaml", f"model.name={model}"])
    _one_line_error(p, 2, "model.trust_remote_code")


def test_a_looping_chat_template_is_bounded(run):
    (run / "adapter" / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    p = run_cli(["generate", str(run), "--chat", "--prompt", "hi"], env={"FINETUNE_TEMPLATE_SECONDS": "2"},
                timeout=120)
    _one_line_error(p, 2, "the chat template: did not finish within 2 s")
