"""Kill points: a forked child stops at a chosen moment of a run or of a checkpoint save and waits there, so
the test signals it exactly there, whatever the machine's load.

The child (`install(point, marker)` before it starts its work) writes `marker` when it arrives and then
waits; the parent waits for that file (`wait_for`: an event, never a delay) and sends its signal. A signal
whose handler raises (a second Ctrl-C) ends the wait with that exception; SIGKILL ends the process there.
A point the child never reaches (a renamed function, a run that ends first) is a failure, not a pass:
`wait_for` raises when the child ends without having written its marker.

The moments (`Point.kind`), each in checkpoint `step-N` (`Point.step`; None: the first save of any step)
unless said otherwise:
- save: at the start of the save, nothing of it written yet (between two saves);
- write: half of the file `Point.name` written (optimizer-rank0.pt, rng-rank0.pt, adapter_model.safetensors,
  scheduler.pt), in the hidden `.tmp-step-N` directory;
- manifest: every file and the manifest written, the directory not yet renamed into place;
- renamed: `step-N` visible, the older checkpoints not yet pruned;
- pruning: the save's first delete of an old checkpoint under way (one file of it gone);
- step: before optimizer step N+1 (step N and its checkpoint done), training runs only;
- metrics: step N's metrics line written, its checkpoint not yet begun (training runs only);
- export: half of the final adapter's weights written, in the hidden `.tmp-adapter` (step unused);
- exported: the final adapter published, the process not yet ended (step unused);
- tokenizing: the first batch of rows is being tokenized (data preparation; step unused).
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

HOLD_LIMIT = 120  # s: a child nobody signals (its test failed) gives up, exit 99, rather than outlive the test


@dataclass(frozen=True)
class Point:
    kind: str
    step: int | None = 0
    name: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.step} {self.name}".strip()


def hold(marker: Path, where: str) -> None:
    """In the child: say where it is (`marker` holds `where`, written whole), then wait for a signal."""
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(where)
    os.replace(tmp, marker)
    deadline = time.monotonic() + HOLD_LIMIT
    while time.monotonic() < deadline:
        time.sleep(0.5)  # a signal handler runs (and may raise) during the sleep
    os._exit(99)


def wait_for(marker: Path, alive, timeout: float = 600) -> str:
    """In the parent: block until the child has reached its point (returns where), else raise. `alive()`
    says whether the child still runs. The timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if not alive() and not marker.exists():
            raise AssertionError(f"the child ended before reaching its kill point ({marker.name})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the child did not reach its kill point in {timeout} s ({marker.name})")
        time.sleep(0.002)
    return marker.read_text()


def _half_write(path: Path, data, marker: Path, where: str) -> None:
    with open(path, "wb") as f:
        f.write(bytes(data)[: len(data) // 2])
        f.flush()
    hold(marker, where)


def install(point: Point, marker: Path) -> None:
    """In the child, before its work starts: hold at `point` (see the module doc)."""
    from finetune.train.keepers import checkpoint
    from finetune.util import atomic

    where, step, seen = str(point), point.step, {"first": None, "saving": None}

    def this(n) -> bool:
        """Whether checkpoint step-n is the point's: its step, or (step None) the first one saved."""
        return n is not None and n == (step if step is not None else seen["first"])

    real_save = checkpoint.save

    def save(root, n, **kwargs):
        seen["saving"] = n
        seen["first"] = n if seen["first"] is None else seen["first"]
        if point.kind == "save" and this(n):
            hold(marker, where)
        return real_save(root, n, **kwargs)

    checkpoint.save = save

    if point.kind in ("write", "export"):
        real_write = atomic.write_bytes

        def write_bytes(path, data):
            path = Path(path)
            if point.kind == "write" and path.name == point.name and any(
                    part.startswith(".tmp-step-") and this(int(part.split("-")[-1])) for part in path.parts):
                _half_write(path, data, marker, where)
            if point.kind == "export" and path.parent.name == ".tmp-adapter" and path.suffix == ".safetensors":
                _half_write(path, data, marker, where)
            real_write(path, data)

        atomic.write_bytes = write_bytes
    elif point.kind in ("manifest", "renamed"):
        real_replace = atomic.replace_dir

        def replace_dir(tmp, final):
            n = int(Path(final).name.split("-")[-1]) if Path(final).name.startswith("step-") else None
            if point.kind == "manifest" and this(n):
                hold(marker, where)
            real_replace(tmp, final)
            if point.kind == "renamed" and this(n):
                hold(marker, where)

        atomic.replace_dir = replace_dir
    elif point.kind == "pruning":
        import shutil

        real_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            path = Path(path)
            if this(seen["saving"]) and re.fullmatch(r"(\.del-)?step-\d+", path.name) and path.is_dir():
                (path / "optimizer-rank0.pt").unlink()  # the delete under way: a file gone, the rest still there
                hold(marker, where)
            real_rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree
    elif point.kind == "exported":
        real_publish = checkpoint.publish_dir

        def publish_dir(final, build):
            out = real_publish(final, build)
            if Path(final).name == "adapter":
                hold(marker, where)
            return out

        checkpoint.publish_dir = publish_dir
    elif point.kind == "tokenizing":
        from finetune.data import prepare

        real_encode = prepare._encode_batch

        def encode_batch(*args, **kwargs):
            hold(marker, where)
            return real_encode(*args, **kwargs)

        prepare._encode_batch = encode_batch
    elif point.kind in ("step", "metrics"):
        from finetune.train import loop
        from finetune.train.keepers.metrics import Metrics

        if point.kind == "step":
            real_step = loop.optimizer_step

            def optimizer_step(run, stop=None):
                if run.step == step:
                    hold(marker, where)
                return real_step(run, stop)

            loop.optimizer_step = optimizer_step
        else:
            real_log = Metrics.log

            def log(self, n, **values):
                real_log(self, n, **values)
                if n == step and "loss" in values:
                    hold(marker, where)

            Metrics.log = log
    elif point.kind != "save":
        raise ValueError(f"unknown kill point {point.kind!r}")
