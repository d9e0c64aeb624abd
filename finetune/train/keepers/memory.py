"""Measured memory per phase of a run, named after the phases of finetune.train.loop._train (PHASES): load (the
setup, the resume checkpoint opened, the base loaded: under FSDP placeholders only), adapters (LoRA, the
checkpoint's adapter, the optimizer), wrap (FSDP's or DDP's wrap), fill (each rank's shards of the base
streamed in), restore (a resume's optimizer, schedule, RNG, scaler), forward (the lean modules and activation
offloading), reference (DPO's reference pass over every pair), steps, eval, save (checkpoints), export (the
final adapter). The planner's `load` is the whole streamed load, which under FSDP ends in `fill`.

On a GPU each phase records torch's peak allocated and reserved bytes on this process's device, the peaks reset
when the phase starts, so each figure belongs to its phase alone. On CPU (where host RAM is the device memory)
it records the peak resident set size of the phase: the kernel's high-water mark (VmHWM), reset through
/proc/self/clear_refs when the phase starts; where the kernel refuses the reset the figure is the run's peak so
far, and the record says so. A phase entered many times (steps, eval, save) keeps its largest peak.

Every rank measures itself; `write` gathers the ranks' figures into RUN_DIR/memory.json on the main process.

With FINETUNE_MEMORY_TRACE=DIR on a GPU, torch's allocator also records every allocation of the run with its
Python stack, and each rank writes DIR/memory_trace_rank{N}.json: the allocations alive at the run's peak,
grouped by the line of finetune or of a library that made them (`peak_sites`). Tracing slows the steps; it
is for finding where a peak comes from.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

PHASES = ("load", "adapters", "wrap", "fill", "restore", "forward", "reference", "steps", "eval", "save", "export")
# The phases the planner's load figure spans: under FSDP the streamed load ends when the shards are filled.
LOAD_PHASES = ("load", "adapters", "wrap", "fill")
TRACE_ENV = "FINETUNE_MEMORY_TRACE"
# Frames worth naming as the place an allocation comes from: ours first, then the libraries that allocate.
SITE_PACKAGES = ("/finetune/", "/peft/", "/bitsandbytes/", "/transformers/", "/accelerate/", "/torch/distributed/")


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
        import os

        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            # The allocator's statistics exist once CUDA is initialised; a one-process run measures its
            # first phase before anything has touched the GPU ("Invalid device argument" on an H200).
            torch.cuda.init()
        self.phases: dict[str, dict] = {}
        self.checkpointed: int | None = None  # decoder layers checkpointed, when not all (train.recompute)
        self.attention: dict | None = None  # which attention kernels ran (finetune.train.sdpa), set at setup
        # What the process held before the run's first phase (imports, the CUDA context on a GPU): a phase's
        # growth is its peak less this.
        rss = _proc_status_kib("VmRSS")
        self.start_rss = None if rss is None else rss * 1024
        self.trace_dir = os.environ.get(TRACE_ENV) if self.cuda else None
        if self.trace_dir:
            # torch's documented way to see what holds GPU memory ("Understanding CUDA Memory Usage")
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=device)

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda:
            # The caching allocator counts on the host, as each kernel is queued: no synchronization (the
            # steps phase is entered every optimizer step, which reads the device once, at its end).
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

    def write(self, run_dir: Path, acc, recipe) -> dict | None:
        """Gather every rank's phases; the main process writes RUN_DIR/memory.json, with the planner's figures
        for the same phases (`planned`), and returns it."""
        import torch.distributed as dist

        if self.trace_dir:
            self._write_trace(dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
        mine = {"device": str(self.device), "start_rss": self.start_rss, "phases": self.phases}
        ranks = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        if not acc.is_main_process:
            return None
        plan = planned(recipe, acc.num_processes, self.cuda, max(r["start_rss"] or 0 for r in ranks),
                       self.checkpointed)
        out = {"kind": "cuda" if self.cuda else "cpu_rss", "ranks": ranks, "plan": plan,
               "attention": self.attention}  # finetune.train.sdpa's record (rank 0's: every rank runs the same)
        from finetune.util.atomic import write_text

        write_text(run_dir / "memory.json", json.dumps(out, indent=1) + "\n")
        return out


    def _write_trace(self, rank: int) -> None:
        snap = torch.cuda.memory._snapshot(self.device)
        torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        trace = snap["device_traces"][self.device.index or 0]
        out = Path(self.trace_dir)
        out.mkdir(parents=True, exist_ok=True)
        from finetune.util.atomic import write_text

        write_text(out / f"memory_trace_rank{rank}.json", json.dumps(peak_sites(trace), indent=1) + "\n")


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost frame in finetune or an allocating library, with the
    innermost frame of all (the operator) beside it."""
    op = f"{frames[0].get('name')}" if frames else "?"
    for f in frames:
        if any(p in f.get("filename", "") for p in SITE_PACKAGES):
            name = f["filename"]
            tail = name.split("/site-packages/")[-1] if "/site-packages/" in name else \
                "finetune/" + name.split("/finetune/", 1)[-1] if "/finetune/" in name else name
            return f"{tail}:{f.get('line')} {f.get('name')} [{op}]"
    return f"(no library frame) [{op}]"


def peak_sites(trace: list[dict], top: int = 15) -> dict:
    """Replay an allocator trace (torch's TraceEntry list): the peak of live bytes, and the allocations alive
    at that moment summed by `_site`, largest first."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames") or []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and e.get("addr") in live:
            total -= live.pop(e["addr"])[0]
    sites: dict[str, int] = {}
    for size, site in at_peak.values():
        sites[site] = sites.get(site, 0) + size
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_bytes_traced": peak, "entries": len(trace),
            "sites": [{"site": k, "bytes": v, "gib": round(v / 2**30, 3)} for k, v in ranked]}


def planned(recipe, world: int, cuda: bool, start_rss: int = 0, checkpointed: int | None = None) -> dict | None:
    """`finetune estimate`'s figures for the phases it plans, per process, in bytes, for this run as launched:
    on a GPU what torch counts (the CUDA context and NCCL buffers left out): the load, and the steps' peak
    allocated and reserved; on CPU the machine's planned RAM shared by its processes (load, steps, save).
    None when the planner does not know the model's shapes."""
    import dataclasses

    from finetune.plan.estimate import build, from_recipe, start_offset
    from finetune.util.errors import RecipeError

    try:
        s = dataclasses.replace(from_recipe(recipe), gpus=world, device="cuda" if cuda else "cpu")
        if checkpointed is not None:  # the count the run resolved (auto, or N): not the recipe's word
            s = dataclasses.replace(s, checkpointing=checkpointed)
        p = build(s)
    except (RecipeError, KeyError, ValueError):
        return None
    if cuda:
        outside = sum(p.overhead.get(k, 0) for k in ("cuda_context", "nccl"))
        return {"load": p.load_gpu - outside, "steps": p.allocated, "steps_reserved": p.reserved}
    # The plan's process constant assumes a CPU process of CPU_START_RSS after its imports; the pages of the
    # same libraries mapped differ by machine and page cache (measured: 0.23 and 0.29 GiB for one venv's two
    # checkouts on one machine), so the run puts its own start in the constant's place.
    per, mapped = s.per_machine, start_offset(start_rss)
    return {k: p.cpu[phase] // per + mapped for k, phase in (("load", "loading"), ("steps", "training"),
                                                              ("save", "saving"))}


def tracker_values(memory: dict) -> dict:
    """memory.json's measured peaks as tracker metrics (the largest rank's, GiB), `memory/<phase>_<what>`; the
    planned figures are in the tracker's config already (trackers.run_config's `plan`)."""
    keys = ("peak_allocated", "peak_reserved") if memory["kind"] == "cuda" else ("peak_rss",)
    out = {}
    for name in PHASES:
        per_rank = [r["phases"][name] for r in memory["ranks"] if name in r["phases"]]
        for k in keys:
            values = [p.get(k) for p in per_rank if p.get(k) is not None]
            if values:
                out[f"memory/{name}_{k}_gib"] = round(max(values) / 2**30, 4)
    return out


def table(memory: dict) -> str:
    """The end-of-run summary: one line per phase, the largest rank's figures in GiB, and the planner's
    figure for the phases it plans (GPU: the load against peak reserved, the steps against peak allocated)."""
    gib = 2**30
    cuda = memory["kind"] == "cuda"
    plan = memory.get("plan") or {}
    lines = ["phase      peak allocated   peak reserved   plan" if cuda else "phase      peak RSS        plan"]
    for name in PHASES:
        per_rank = [r["phases"][name] for r in memory["ranks"] if name in r["phases"]]
        if not per_rank:
            continue
        planned_here = f"{plan[name] / gib:>8.2f} GiB" if name in plan else ""
        if cuda:
            a = max(p["peak_allocated"] for p in per_rank) / gib
            r = max(p["peak_reserved"] for p in per_rank) / gib
            lines.append(f"{name:<10} {a:>10.2f} GiB  {r:>10.2f} GiB  {planned_here}".rstrip())
        else:
            v = max((p["peak_rss"] or 0) for p in per_rank) / gib
            lines.append(f"{name:<10} {v:>10.2f} GiB  {planned_here}".rstrip())
    return "\n".join(lines)
