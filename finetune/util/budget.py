"""A wall-clock budget for code finetune runs but did not write: a chat template from a run dir or a
tokenizer is a Jinja program, and one that loops (nested `range`s) never returns. Rendering one chat takes
milliseconds, so the budget (`FINETUNE_TEMPLATE_SECONDS`, default 10 s) only ever stops a runaway.

SIGALRM (ITIMER_REAL) interrupts the Python bytecode the template compiles to; outside the main thread, where
no signal handler can be installed, the code runs unbounded (as before).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

from finetune.util.errors import RecipeError


class _Expired(Exception):
    pass


def seconds() -> float:
    try:
        return max(float(os.environ.get("FINETUNE_TEMPLATE_SECONDS", "10")), 0.01)
    except ValueError:
        return 10.0


@contextlib.contextmanager
def limited(what: str, fix: str, error: type = RecipeError):
    """Run the block within `seconds()`; past it, `error` (a RecipeError: exit 2) naming `what` and `fix`."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds())
    try:
        yield
    except _Expired:
        raise error([f"{what}: did not finish within {seconds():g} s (a loop that never ends?); {fix}"]) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
