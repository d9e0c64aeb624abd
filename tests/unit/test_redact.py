"""Secrets (values of *TOKEN*/*KEY*/*SECRET*/*PASSWORD* variables, Hugging Face tokens) are masked in
what finetune writes. The end-to-end check (a planted token searched for in every file a run writes)
is tests/integration/test_security.py."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from finetune import recipe as R
from finetune.recipe.rundir import read_recipe, write_recipe
from finetune.util import redact as X

ROOT = Path(__file__).resolve().parents[2]
HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
ENV = {"HF_TOKEN": HF, "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567", "DB_PASSWORD": "s3cret-Pass",
       "PIP_KEYRING_PROVIDER": "subprocess", "SSH_KEY_PATH": "/root/.ssh/id_ed25519", "MY_TOKEN": "short1",
       "HOME": "/root", "PATH_KEY_WORDS": "plain words here"}


def test_only_secret_shaped_values_of_secret_named_variables():
    assert set(X.secret_values(ENV)) == {HF, ENV["WANDB_API_KEY"], "s3cret-Pass"}


def test_redact_masks_values_and_token_shapes():
    text = f"token {HF} key={ENV['WANDB_API_KEY']} pw 's3cret-Pass' other hf_{'x' * 34} subprocess /root"
    out = X.redact(text, ENV)
    assert HF not in out and ENV["WANDB_API_KEY"] not in out and "s3cret-Pass" not in out and "hf_xxx" not in out
    assert out.count(X.MASK) == 4 and "subprocess /root" in out
    assert X.redact_obj({"a": [HF, 3, {"b": f"x{HF}y"}]}, ENV) == {"a": ["***", 3, {"b": "x***y"}]}


def test_recipe_written_to_the_run_dir_has_no_secret_and_still_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF)
    r = R.from_dict({"model": {"revision": HF}, "data": {"chat_template": f"{{{{ '{HF}' }}}}"}})
    write_recipe(tmp_path, r)
    text = (tmp_path / "recipe.yaml").read_text()
    assert HF not in text
    back = read_recipe(tmp_path)
    assert back.model.revision == X.MASK and back.train == r.train


def test_stream_wrapper_masks_print_and_delegates(monkeypatch):
    monkeypatch.setenv("DB_PASSWORD", "s3cret-Pass")
    raw = io.StringIO()
    stream = X.RedactingStream(raw)
    print("login with s3cret-Pass", file=stream)
    stream.writelines(["a s3cret-Pass\n"])
    assert raw.getvalue() == "login with ***\na ***\n" and stream.getvalue() == raw.getvalue()


def test_cli_error_messages_do_not_echo_a_pasted_token():
    """A token pasted into an override comes back in the validation error ("got '...'"), masked."""
    out = subprocess.run([sys.executable, "-m", "finetune", "validate", "recipes/tiny_cpu.yaml", f"train.seed={HF}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "train.seed" in out.stderr
    assert HF not in out.stderr + out.stdout and "***" in out.stderr


def test_secrets_that_repr_or_json_escape_are_masked_in_their_escaped_form(monkeypatch, capsys):
    """A secret with a backslash, a quote or a non-ASCII character is printed escaped by repr() (an error's
    "got '...'") and by JSON; the escaped form is masked as well as the raw one."""
    from finetune import cli

    secret = 'Pa\\ss"w\u00f6rd-42'  # a backslash, a double quote, a non-ASCII character
    env = {"DB_PASSWORD": secret}
    for shown in (secret, repr(secret), ascii(secret), json.dumps(secret), json.dumps(secret, ensure_ascii=False)):
        out = X.redact(f"got {shown}!", env)
        assert "***" in out and "rd-42" not in out and "Pa" not in out, (shown, out)
    monkeypatch.setenv("DB_PASSWORD", secret)
    assert cli.main(["validate", str(ROOT / "recipes" / "tiny_cpu.yaml"), f"train.seed={secret}"]) == 2
    err = capsys.readouterr().err
    assert "train.seed" in err and "***" in err and "w\\xf6rd" not in err and "Pa\\\\ss" not in err
