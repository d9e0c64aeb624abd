"""Measured memory per phase of a run: load, wrap, steps, eval, save, export.

On a GPU each phase records torch's peak allocated and reserved bytes on this process's device, the peaks reset
when the phase starts, so each figure belongs to its phase alone. On CPU (where host RAM is the device memory)
it records the peak resident set size of the phase: the kernel's high-water mark (VmHWM), reset through
/proc/self/clear_refs when the phase starts; where the kernel refuses the reset the figure is the run's peak so
far, and the record says so. A phase entered many times (steps, eval, save) keeps its largest peak.

Every rank measures itself; `write` gathers the ranks' figures into RUN_DIR/memory.json on the main process.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

PHASES = ("load", "wrap", "steps", "eval", "save", "export")


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+: writing 5 to clear_refs); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PhaseMemory:
    """Peak memory of this process, phase by phase (see the module doc)."""

    @classmethod
    def for_this_process(cls) -> "PhaseMemory":
        """This process's device: its local rank's GPU when CUDA is there (as the Accelerator will pick), else CPU."""
        import os

        if torch.cuda.is_available():
            return cls(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
        return cls(torch.device("cpu"))

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.phases: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            reset = True
        else:
            reset = _reset_rss_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._record(name, reset, time.perf_counter() - start)

    def _record(self, name: str, reset: bool, seconds: float) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            now = {"peak_allocated": torch.cuda.max_memory_allocated(self.device),
                   "peak_reserved": torch.cuda.max_memory_reserved(self.device),
                   "allocated_after": torch.cuda.memory_allocated(self.device)}
        else:
            hwm, rss = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
            now = {"peak_rss": None if hwm is None else hwm * 1024,
                   "rss_after": None if rss is None else rss * 1024, "peak_is_phase_only": reset}
        old = self.phases.get(name)
        if old is None:
            self.phases[name] = {**now, "seconds": seconds, "entries": 1}
            return
        for k, v in now.items():  # keep the largest peak of every entry, the last figure after it
            if k.startswith("peak_") and isinstance(v, int):
                old[k] = max(old[k] or 0, v)
            else:
                old[k] = v
        old["seconds"] += seconds
        old["entries"] += 1

    def write(self, run_dir: Path, acc) -> dict | None:
        """Gather every rank's phases; the main process writes RUN_DIR/memory.json and returns it."""
        import torch.distributed as dist

        mine = {"device": str(self.device), "phases": self.phases}
        ranks = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        if not acc.is_main_process:
            return None
        out = {"kind": "cuda" if self.cuda else "cpu_rss", "ranks": ranks}
        from finetune.util.atomic import write_text

        write_text(run_dir / "memory.json", json.dumps(out, indent=1) + "\n")
        return out


def table(memory: dict) -> str:
    """The end-of-run summary: one line per phase, the largest rank's figures, in GiB."""
    gib = 2**30
    lines = []
    cuda = memory["kind"] == "cuda"
    head = "phase    peak allocated   peak reserved" if cuda else "phase    peak RSS"
    lines.append(head)
    for name in PHASES:
        per_rank = [r["phases"][name] for r in memory["ranks"] if name in r["phases"]]
        if not per_rank:
            continue
        if cuda:
            a = max(p["peak_allocated"] for p in per_rank) / gib
            r = max(p["peak_reserved"] for p in per_rank) / gib
            lines.append(f"{name:<8} {a:>10.2f} GiB  {r:>10.2f} GiB")
        else:
            v = max((p["peak_rss"] or 0) for p in per_rank) / gib
            lines.append(f"{name:<8} {v:>10.2f} GiB")
    return "\n".join(lines)
