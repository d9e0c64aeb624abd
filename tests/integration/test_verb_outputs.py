"""Finished work is never replaced silently, run dirs cannot be turned against their owner, and every verb's
output path is checked: a finished run re-run with other values, links planted in the run dir, a non-UTF-8
output.dir, export/accelerate-config pointed at files they did not write, quantize's temporaries, umask and a
full disk, secrets with spaces. Each ends with exit 0 (refused work left intact) or 1/2 and one line; no
traceback."""
import os
import resource
import shutil
import stat
import subprocess
import sys

import pytest

from ..conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def _refused(p, code, *needles):
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in p.stderr, p.stderr[-3000:]


def _snapshot(run):
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_finished_run_is_not_retrained_with_other_values_without_overwrite(run):
    shutil.rmtree(run / "checkpoints")  # pruned, or keep_checkpoints: 0: nothing to resume from
    before = _snapshot(run)
    p = run_cli([str(run / "recipe.yaml"), f"output.dir={run}", "train.learning_rate=0.001"])
    _refused(p, 2, "holds a finished run", "train.learning_rate", "--overwrite")
    assert _snapshot(run) == before
    p = run_cli([str(run / "recipe.yaml"), f"output.dir={run}", "train.learning_rate=0.001", "--overwrite"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "learning_rate: 0.001" in (run / "recipe.yaml").read_text()


@pytest.mark.parametrize("name", [".lock", "recipe.yaml", "metrics.jsonl", "checkpoints/step-3"])
def test_links_planted_in_the_run_dir_are_refused(run, tmp_path, name):
    victim = tmp_path / "victim"
    victim.mkdir() if name.startswith("checkpoints") else victim.write_text("another user's file\n")
    target = run / name
    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    target.symlink_to(victim)
    p = run_cli([str(ROOT / "recipes" / "tiny_cpu.yaml"), f"output.dir={run}", "train.max_steps=4",
                 "train.warmup_steps=0", "train.save_every=1", "train.keep_checkpoints=3"])
    _refused(p, 2, f"{target} is a symbolic link")
    assert list(victim.iterdir()) == [] if victim.is_dir() else victim.read_text() == "another user's file\n"


def test_an_output_dir_that_is_not_utf8_is_refused_before_training(tmp_path):
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")
    p = run_cli(["recipes/tiny_cpu.yaml", f"output.dir={out}", "train.max_steps=2", "train.warmup_steps=0"])
    _refused(p, 2, "output.dir", "not UTF-8")
    assert not os.path.exists(out)


def test_export_refuses_to_replace_what_it_did_not_write(run):
    from finetune.gguf import converter
    from finetune.util.errors import RecipeError

    try:
        converter.require()
    except RecipeError as e:
        pytest.skip(str(e))
    adapter = run / "adapter" / "adapter_model.safetensors"
    before = adapter.read_bytes()
    for out in (adapter, run / "adapter"):
        p = run_cli(["export", str(run), "--adapter-only", "--greedy-prompts", "0", "--output", str(out)])
        _refused(p, 2, "--output")
    assert adapter.read_bytes() == before
    # A temporary left by a killed export is removed by the next one; the GGUF follows the umask.
    (run / "gguf").mkdir()
    stale = run / "gguf" / ".adapter-f16.gguf.tmp-killed"
    stale.write_bytes(b"\0" * 100_000)
    p = subprocess.run(["sh", "-c", f"umask 022; exec {sys.executable} -m finetune export {run} --adapter-only "
                        "--greedy-prompts 0"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name for f in (run / "gguf").iterdir()) == ["adapter-f16.gguf", "adapter-f16.gguf.json"]
    assert stat.S_IMODE((run / "gguf" / "adapter-f16.gguf").stat().st_mode) == 0o644
    # A full disk (the kernel refuses writes past 30 kB, as a full disk would) is one line; the GGUF stays.
    before = (run / "gguf" / "adapter-f16.gguf").read_bytes()
    p = subprocess.run([sys.executable, "-m", "finetune", "export", str(run), "--adapter-only", "--greedy-prompts",
                        "0"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, resource.RLIM_INFINITY)))
    _refused(p, 1, "could not write the GGUF")
    assert (run / "gguf" / "adapter-f16.gguf").read_bytes() == before
    assert sorted(f.name for f in (run / "gguf").iterdir()) == ["adapter-f16.gguf", "adapter-f16.gguf.json"]


def test_accelerate_config_never_overwrites_the_recipe_and_redacts_secrets(run, tmp_path):
    before = (run / "recipe.yaml").read_bytes()
    p = run_cli(["accelerate-config", str(run / "recipe.yaml"), "-o", str(run / "recipe.yaml")])
    _refused(p, 2, "not a launcher config that accelerate-config wrote")
    assert (run / "recipe.yaml").read_bytes() == before
    secret = "My pass phrase 42"
    out = tmp_path / "launch.yaml"
    for _ in range(2):  # the second run replaces the file it wrote
        p = run_cli(["accelerate-config", "recipes/tiny_cpu.yaml", f"model.revision={secret}", "-o", str(out)],
                    env={"DB_PASSWORD": secret})
        assert p.returncode == 0, p.stderr[-3000:]
    text = out.read_text()
    assert secret not in text and "model.revision=***" in text


def _quantize(out, umask="022", limit=None):
    def before():
        if limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return subprocess.run(["sh", "-c", f"umask {umask}; exec {sys.executable} -m finetune quantize "
                           f"recipes/tiny_cpu.yaml --output {out}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, preexec_fn=before)


def test_quantize_cleans_stale_temporaries_honours_the_umask_and_reports_a_full_disk(tmp_path):
    stale = tmp_path / ".q.tmp-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 100_000)
    p = _quantize(tmp_path / "q")
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["q"]
    assert stat.S_IMODE((tmp_path / "q").stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "q").iterdir()} == {0o644}
    # The kernel refuses writes past 200 kB (EFBIG, as a full disk refuses them with ENOSPC).
    p = _quantize(tmp_path / "q2", limit=200_000)
    _refused(p, 1, "the file size limit was reached")
    assert len(p.stderr.strip().splitlines()[-1]) < 400 and sorted(f.name for f in tmp_path.iterdir()) == ["q"]
