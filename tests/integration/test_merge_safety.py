"""Merge output safety: --force replaces only a previous merge, the output is readable as the umask says, a
killed merge's temporaries are removed by the next one, and a full disk, a missing shard or a missing
tokenizer are one clear error with nothing partial left."""
import fcntl
import json
import os
import resource
import shutil
import signal
import stat

import pytest

from finetune import cli
from finetune.merge.stream import merge

from .conftest import make_run_dir

pytestmark = pytest.mark.slow


def test_force_replaces_only_a_directory_a_merge_wrote(tiny_run, tmp_path, capsys):
    out = tmp_path / "checkpoints"
    (out / "step-2").mkdir(parents=True)
    (out / "step-2" / "optimizer.pt").write_text("precious")
    assert cli.main(["merge", str(tiny_run), "--output", str(out), "--no-check", "--force"]) == 2
    err = capsys.readouterr().err
    assert "was not written by finetune merge" in err and "Traceback" not in err
    assert (out / "step-2" / "optimizer.pt").read_text() == "precious"


def test_output_follows_the_umask_and_stale_temporaries_are_removed(tiny_run, tmp_path):
    out = tmp_path / "m"
    stale = tmp_path / ".m.tmp-killed"  # what a merge killed mid-way leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 4096)
    busy = tmp_path / ".m.tmp-running"  # a merge running now: its lock is held
    busy.mkdir()
    fd = os.open(busy, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    old = os.umask(0o022)
    try:
        merge(tiny_run, out, check=False)
    finally:
        os.umask(old)
        os.close(fd)
    assert not stale.exists() and busy.exists()
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.tmp-running", "m"]


def test_a_full_disk_is_one_line_and_the_previous_output_stays(tiny_run, tmp_path, capsys):
    out = tmp_path / "m"
    merge(tiny_run, out, check=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    # The kernel refuses writes past 200 kB (EFBIG, as a full disk refuses them with ENOSPC). In this process:
    # a forked child could deadlock in torch's thread pool.
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
    try:
        code = cli.main(["merge", str(tiny_run), "--output", str(out), "--no-check", "--force", "--dtype", "fp32"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    err = capsys.readouterr().err
    assert code == 1 and "merge: writing" in err and "the file size limit was reached" in err, err
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def _run_with_base(tmp_path, edit):
    """A run dir whose adapter points at a copy of the tiny base, changed by `edit(base_dir)`."""
    from finetune.util import builtin as tiny

    base = tmp_path / "base"
    shutil.copytree(tiny.model_dir(), base)
    edit(base)
    run = make_run_dir(tmp_path)
    cfg_path = run / "adapter" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "base_model_name_or_path": str(base)}))
    return run


def test_an_index_naming_a_missing_shard_is_named(tmp_path, capsys):
    def edit(base):
        (base / "model.safetensors").rename(base / "model-00001-of-00002.safetensors")
        (base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))

    run = _run_with_base(tmp_path, edit)
    assert cli.main(["merge", str(run), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert "model-00002-of-00002.safetensors" in err and "Traceback" not in err and not (run / "merged").exists()


def test_a_base_and_adapter_without_tokenizer_are_named(tmp_path, capsys):
    def edit(base):
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (base / name).unlink(missing_ok=True)

    run = _run_with_base(tmp_path, edit)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (run / "adapter" / name).unlink(missing_ok=True)
    assert cli.main(["merge", str(run), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer in the adapter" in err and "Traceback" not in err and not (run / "merged").exists()
