"""Keep secrets out of everything a run writes: stdout/stderr, metrics.jsonl, the run dir's recipe.yaml.

A secret is the value of an environment variable whose name says so (HF_TOKEN, WANDB_API_KEY,
AWS_SECRET_ACCESS_KEY, DB_PASSWORD, ...) or anything shaped like a Hugging Face access token. Nothing in
finetune prints the environment, but values travel: a token pasted into a recipe field or an override ends
up in error messages ("got '...'") and in the resolved recipe. Writers pass their text through `redact`.
"""
from __future__ import annotations

import json
import os
import re
import sys

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.I)
HF_TOKEN_SHAPE = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")
MASK = "***"
MIN_LEN = 8


def _looks_secret(value: str) -> bool:
    """Long enough and not a plain word or a path: a variable named *_KEY may hold `subprocess` or a
    file path, and masking every `subprocess` in the logs would only hide information. A value with spaces
    (a pass phrase) is judged by its other characters: "plain words here" is not masked, "My pass 42" is."""
    if len(value.strip()) < MIN_LEN:
        return False
    if value.startswith(("/", "~", "./")) or os.path.exists(value):
        return False
    chars = [c for c in value if not c.isspace()]
    classes = sum((any(c.islower() for c in chars), any(c.isupper() for c in chars),
                   any(c.isdigit() for c in chars), any(not c.isalnum() for c in chars)))
    return classes >= 2


def _escaped_forms(value: str) -> set[str]:
    """The value as it appears inside repr()/ascii() (error messages' "got '...'") and JSON strings: a
    secret holding a backslash, a quote or a non-ASCII character is printed escaped, not verbatim."""
    return {value, repr(value)[1:-1], ascii(value)[1:-1], json.dumps(value)[1:-1],
            json.dumps(value, ensure_ascii=False)[1:-1]}


def secret_values(env=None) -> list[str]:
    env = os.environ if env is None else env
    found = set()
    for k, v in env.items():
        if SECRET_NAME.search(k) and _looks_secret(v):
            found |= _escaped_forms(v)
    return sorted(found, key=len, reverse=True)  # longest first: a secret containing another is masked whole


def redact(text: str, env=None) -> str:
    for value in secret_values(env):
        text = text.replace(value, MASK)
    return HF_TOKEN_SHAPE.sub(MASK, text)


def redact_obj(obj, env=None):
    """The same for every string in nested dicts/lists (before they are serialised, so the mask cannot
    break YAML or JSON syntax)."""
    if isinstance(obj, str):
        return redact(obj, env)
    if isinstance(obj, dict):
        return {k: redact_obj(v, env) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v, env) for v in obj)
    return obj


class RedactingStream:
    """A text stream that masks secrets in what is written and delegates everything else."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(redact(text) if isinstance(text, str) else text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install():
    """Mask secrets in this process's stdout and stderr (logging, warnings, tracebacks, progress bars all
    write there). Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
