"""The verbs that read a run dir (eval, generate, chat, merge, export) given what a careful user or a hostile
file gives them: a chat template that tries to escape the sandbox, loads other templates, loops or has no
system turn; an empty or truncated adapter_config.json; bytes that are not UTF-8 in an argument or on chat's
stdin. Each is exit 2 with one line naming the file, argument or input line, no traceback (cli.main is
called in-process: an exception would fail the test), and nothing written into the run dir. Most refusals
come before the model loads, so each call costs a tokenizer load."""
import io
import shutil
import sys

import pytest

from finetune import cli

INJECTION = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
INCLUDE = "{% include 'other.jinja' %}{% for m in messages %}{{ m.content }}{% endfor %}"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{{ '<|' + m.role + '|>' + m.content }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
VERBS = {"generate": ["--chat", "--prompt", "hi", "--max-new-tokens", "2"], "chat": ["--max-new-tokens", "2"],
         "eval": [], "export": ["--greedy-prompts", "0"], "merge": ["--no-check"]}


@pytest.fixture
def run(tiny_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(tiny_run, copy)
    return copy


def _listing(run):
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


def _main(argv, stdin: bytes | None = None, monkeypatch=None) -> int:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    return cli.main(argv)


def _one_line(capsys, *needles):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("template, tried", [(INJECTION, "the sandbox refused (access to attribute '__class__'"),
                                             (INCLUDE, "tried to load another template")],
                         ids=["injection", "include"])
@pytest.mark.parametrize("verb", ["generate", "chat", "eval", "export"])
def test_a_hostile_template_in_the_run_is_refused_by_name(run, verb, template, tried, capsys, monkeypatch):
    (run / "adapter" / "chat_template.jinja").write_text(template)
    before = _listing(run)
    assert _main([verb, str(run), *VERBS[verb]], b"hi\n" if verb == "chat" else None, monkeypatch) == 2
    _one_line(capsys, str(run / "adapter" / "chat_template.jinja"), tried)
    assert _listing(run) == before  # export merged nothing and wrote no GGUF


def test_a_template_without_a_system_turn_is_said_once(run, capsys, monkeypatch):
    (run / "adapter" / "chat_template.jinja").write_text(NO_SYSTEM)
    for verb in ("generate", "chat"):
        assert _main([verb, str(run), *VERBS[verb], "--system", "be brief"], b"hi\nagain\n", monkeypatch) == 2
        err = _one_line(capsys, "--system: the model's template has no system turn", "System role not supported")
        assert err.count("no system turn") == 1
    assert cli.main(["generate", str(run), *VERBS["generate"]]) == 0  # the template itself renders a user turn


def test_a_looping_template_in_chat_is_one_error_not_a_line_that_does_not_fit(run, capsys, monkeypatch):
    (run / "adapter" / "chat_template.jinja").write_text(LOOP)
    monkeypatch.setenv("FINETUNE_TEMPLATE_SECONDS", "0.3")
    assert _main(["chat", str(run), *VERBS["chat"]], b"one\ntwo\nthree\n", monkeypatch) == 2
    err = _one_line(capsys, "chat_template.jinja: the chat template: did not finish within 0.3 s")
    assert "does not fit" not in err and err.count("did not finish") == 1, err


@pytest.mark.parametrize("content", [b"", b'{"peft_type": "LO', b"[]"], ids=["empty", "truncated", "a-list"])
@pytest.mark.parametrize("verb", ["eval", "generate", "chat", "merge", "export"])
def test_a_damaged_adapter_config_is_refused_by_name(run, verb, content, capsys, monkeypatch):
    (run / "adapter" / "adapter_config.json").write_bytes(content)
    before = _listing(run)
    assert _main([verb, str(run), *VERBS[verb]], b"hi\n" if verb == "chat" else None, monkeypatch) == 2
    _one_line(capsys, str(run / "adapter" / "adapter_config.json"), "restore it from the newest checkpoint")
    assert _listing(run) == before


@pytest.mark.parametrize("argv, where", [
    (["generate", "RUN", "--prompt", "caf\udce9"], "--prompt"),  # b"caf\xe9" as Python hands argv over
    (["generate", "RUN", "--chat", "--prompt", "hi", "--system", "\udcff"], "--system"),
    (["generate", "RUN", "--instruction", "x\udcc3"], "--instruction"),
    (["chat", "RUN", "--system", "caf\udce9"], "--system"),
], ids=["generate-prompt", "generate-system", "generate-instruction", "chat-system"])
def test_an_argument_that_is_not_utf8_is_named(run, argv, where, capsys):
    argv = [str(run) if a == "RUN" else a for a in argv]
    assert cli.main(argv) == 2
    _one_line(capsys, f"{where}: not UTF-8 text (byte 0x")


def test_chat_names_the_input_line_that_is_not_utf8_and_decodes_utf8_bytes(run, capsys, monkeypatch):
    assert _main(["chat", str(run), "--max-new-tokens", "2"], b"hello\ncaf\xe9\nnever read\n", monkeypatch) == 2
    _one_line(capsys, "input line 2: not UTF-8 text (byte 0xe9 at position 3)")
    # UTF-8 bytes that a strict (ASCII) locale decoded as surrogates are text: decoded, not refused
    assert cli.main(["generate", str(run), "--prompt", "caf\udcc3\udca9", "--max-new-tokens", "2"]) == 0
    assert '"prompt": "caf\\u00e9"' in capsys.readouterr().out


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of a chosen size (tmpfs; needs the right to mount, else the test is skipped): a
    nearly full disk, whose writes fail with ENOSPC as a real one does."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()

    def make(size_kib: int):
        subprocess.run(["umount", str(mount)], capture_output=True)
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)],
                           capture_output=True, text=True)
        if p.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
        return mount

    yield make
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_merge_onto_a_nearly_full_disk_says_what_it_needs_and_leaves_nothing(tiny_run, small_disk, capsys):
    import math

    from safetensors import safe_open

    from finetune.util import builtin

    with safe_open(str(builtin.model_dir() / "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # merged in fp32
    disk = small_disk(weights // 1024 + 16)  # room for the weights, not for the tokenizer after them
    assert cli.main(["merge", str(tiny_run), "--output", str(disk / "m"), "--no-check", "--dtype", "fp32"]) == 1
    err = _one_line(capsys, f"merge: writing {disk / 'm'} needs about", "free on the disk of", "nothing was written")
    assert err.count("\n") == 1, err
    assert list(disk.iterdir()) == []  # no output dir, no temporary


def test_a_tokenizer_write_that_fills_the_disk_is_the_oserror_it_carries(tiny_run, small_disk):
    """tokenizers reports a failed write as a bare `Exception: No space left on device (os error 28)`: the
    merge's writer turns it into the OSError, which the merge reports in one line (no traceback)."""
    import errno

    import torch

    from finetune.merge.source import resolve_source
    from finetune.merge.stream import _write_extras

    disk = small_disk(16)  # config files fit; tokenizer.json (14 kB), which tokenizers writes itself, does not
    with pytest.raises(OSError) as e:
        _write_extras(resolve_source(tiny_run), disk, torch.float32)
    assert e.value.errno == errno.ENOSPC and str(disk) in str(e.value.filename), e.value
