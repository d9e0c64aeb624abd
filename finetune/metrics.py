"""One sink for everything a run reports: progress bar, stdout lines, metrics.jsonl (rank 0 only)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .distributed import is_main, print0


class Metrics:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress_bar: bool):
        self.main = is_main()
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        if self.main and progress_bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def step(self, step: int, **values):
        """Every optimizer step: advance the bar and show the latest values."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k: _fmt(v) for k, v in values.items()}, refresh=False)

    def log(self, step: int, **values):
        """A logged step: one JSON line, and one printed line when there is no bar."""
        if not self.main:
            return
        record = {"step": step, "time": round(time.perf_counter() - self.t0, 3), **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items())
        if self.bar is not None:
            self.bar.write(line)
        else:
            print0(line)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return v
