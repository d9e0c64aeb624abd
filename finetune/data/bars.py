"""When `datasets` draws its progress bars: never for internal, fast passes (packing runs every epoch), and
only on a terminal for the slow ones (tokenizing), so logs and captured output hold no bar frames: the same
rule as tqdm's `disable=None`, which our own bars use."""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def datasets_bars(show: bool = True):
    """While active, datasets' progress bars are drawn only if `show` and stderr is a terminal."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    hide = was and not (show and sys.stderr.isatty())
    if hide:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            datasets.enable_progress_bars()
