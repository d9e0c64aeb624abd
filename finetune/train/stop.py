"""Stop signals: what a scheduler, a closed terminal or Ctrl-C means for a run.

SIGTERM (preemption), SIGINT (Ctrl-C), SIGHUP (the terminal or ssh session closed) and SIGUSR1 (many
schedulers' warning before the kill, e.g. SLURM's `--signal=USR1@120`) all mean: finish the current step,
write a checkpoint, exit 0. The flag is OR-ed across ranks so they all stop at the same step.

Before training has started (loading, data preparation, resume) there is nothing to checkpoint, so a signal
stops the process at once (KeyboardInterrupt: exit 130) instead of being noticed only at the first step.
A second Ctrl-C while a stop is pending exits at once as well: the previous checkpoint is intact (a
checkpoint being written is never made visible half-done).

A worker started by a launcher (`accelerate launch`, torchrun: each worker in a session of its own) also
stops when the launcher dies however it dies (kill -9, the OOM killer), instead of running on as an orphan
that holds the GPUs and the run lock: the kernel sends it SIGTERM when its parent exits (PR_SET_PDEATHSIG),
and the check between micro-batches also notices a changed parent pid (where prctl is unavailable). It
then checkpoints and exits like a preempted run; re-running resumes.
"""
from __future__ import annotations

import os
import signal

from finetune.util.libc import parent_death_signal
from finetune.util.log import log

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
                     if hasattr(signal, name))


class StopSignal:
    """Installs the handlers (main thread only) and remembers the first stop signal in `signum`."""

    def __init__(self, env=None):
        self.signum = None
        env = os.environ if env is None else env
        # Under a launcher: the parent whose death means "stop". Not for a plain `python -m finetune`, whose
        # parent is a shell (its hangup is SIGHUP, handled below).
        self.launcher = os.getppid() if env.get("TORCHELASTIC_RUN_ID") else None
        self.armed = False  # set when the training loop starts: from then on a signal means checkpoint-and-stop
        self.previous = {}
        for sig in STOP_SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. a notebook worker): no handler, no preemption save
                pass
        if self.launcher is not None and signal.SIGTERM in self.previous:
            parent_death_signal(signal.SIGTERM)

    def launcher_died(self) -> bool:
        """Whether the launcher that started this worker is gone (the worker was re-parented); says so once.
        The kernel's SIGTERM can come before the re-parenting shows: when the launcher's thread that started
        this worker exits first, the worker is handed to another of its threads (the same pid) until the last
        one exits. So the loop asks again after the stop's checkpoint, before saying why it stopped."""
        if self.launcher is None or os.getppid() == self.launcher:
            return False
        log.warning(f"the launcher (pid {self.launcher}) is gone: stopping at the next micro-batch boundary "
                    "with a checkpoint; re-run the same command to resume")
        self.launcher = None  # said once; the stop below stays
        self.signum = self.signum or signal.SIGTERM
        return True

    def _on_signal(self, signum, frame):
        if signum == getattr(signal, "SIGHUP", None):
            _detach_from_closed_terminal()
        if not self.armed:
            raise KeyboardInterrupt(f"signal {signum} before training started")
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt("second Ctrl-C")
        # Nothing is printed here: a print interrupted by a handler that prints raises "reentrant call".
        self.signum = self.signum or signum

    def requested(self, acc, host_group=None) -> bool:
        """Whether any rank was signalled (collective when there are several processes). With `host_group`
        (parallel.host_group: gloo beside a GPU group) the flag stays a host value and the GPU is not
        waited for."""
        self.launcher_died()
        flag = 1.0 if self.signum is not None else 0.0
        if acc.num_processes == 1:
            return flag > 0
        import torch

        if host_group is not None:
            import torch.distributed as dist

            t = torch.tensor([flag], dtype=torch.float64)
            dist.all_reduce(t, group=host_group)
            return float(t.item()) > 0
        t = torch.tensor([flag], dtype=torch.float64, device=acc.device)
        return float(acc.reduce(t, reduction="sum").item()) > 0

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _detach_from_closed_terminal():
    """After a hangup, writing to the terminal fails (EIO) and would crash the checkpoint that follows:
    send what was going to the closed terminal to /dev/null. Redirected output (a log file) is kept."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if os.isatty(fd):
                    os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)
