"""Rank-aware output through `logging`: every process may log, only rank 0 prints (nanochat's `print0`).

`log.info` goes to stdout (progress, notices, results), `log.warning` and above to stderr, each as the bare
message. The streams are looked up when a record is written, so redaction (finetune.util.redact) and test
capture see every line. No accelerator or process group is needed: the rank comes from torch.distributed
once it is initialised, else from the launcher's RANK variable.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("finetune")


def rank() -> int:
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_main()


class _Console(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never take the run down
            self.handleError(record)


if not log.handlers:
    _handler = _Console()
    _handler.addFilter(_RankZero())
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the root logger's handlers (a notebook's, a library's) would print it twice


class _NoHubKernelNotice(logging.Filter):
    """bitsandbytes (0.50, CPUs with AVX512-BF16) warns at import that it could not fetch an optional 4-bit
    matmul from the Hugging Face hub ("pip install kernels"): that kernel is downloaded at run time, which
    finetune never does, and bitsandbytes' own CPU kernel runs instead. Nothing for the user to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoHubKernelNotice())
