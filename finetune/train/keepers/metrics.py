"""One sink for everything a run reports: progress bar, stdout lines, metrics.jsonl and the trackers of
output.report_to (rank 0 only)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from finetune.util import atomic
from finetune.util.errors import explain
from finetune.util.log import is_main, log
from finetune.util.redact import redact


class Metrics:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress_bar: bool, trackers=None):
        self.main = is_main()
        self.trackers = trackers  # keepers.trackers.Trackers: the same records, at the same steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar, before = None, 0.0
        if self.main:
            before = trim(self.path, start_step)
        if self.main and progress_bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.t0 = time.perf_counter() - before  # a resumed run's `time` goes on from the checkpoint's

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
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # no planted link
            with open(fd, "a") as f:
                f.write(redact(json.dumps(record)) + "\n")
        except OSError as e:
            raise explain(e, "writing metrics", self.path) from e
        if self.trackers is not None:
            self.trackers.log(step, record)
        line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items())
        if self.bar is not None:
            self.bar.write(line)
        else:
            log.info(line)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.trackers is not None:
            self.trackers.finish()


def trim(path: Path, start_step: int) -> float:
    """Keep only the records of steps up to `start_step` (where training starts or resumes): the steps
    after it are about to run again, and a process killed mid-write may have left a torn last line.
    Rewritten atomically, so a crash here loses nothing. Returns the last kept record's `time` (seconds)."""
    if not path.exists():
        return 0.0
    keep, last = [], 0.0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start_step:
            keep.append(line + "\n")
            t = record.get("time")
            last = max(last, t) if isinstance(t, (int, float)) else last
    atomic.write_text(path, "".join(keep))
    return last


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return v
