"""Start the real CLI in another process, signal it, wait for it: the helpers the crash and preemption
tests share.

`fork_cli` runs `finetune.cli.main(argv)` in a forked copy of the test process: the same code as
`python -m finetune ARGS` after the interpreter has started and imported torch, which saves seconds per
process and makes 20+ kill trials affordable. `spawn_cli` is the full `python -m finetune` (or any
launcher) command, for the checks that need a fresh interpreter.
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fork_cli(argv: list[str], log: Path, env: dict | None = None, threads: int | None = 1, before=None) -> int:
    """pid of a child running cli.main(argv), its stdout and stderr going to `log`. `threads`: torch's
    CPU threads in the child (one by default, so two children share two cores without slowing each other;
    runs that are compared must use the same number). `before()` runs in the child first (e.g. limits)."""
    from finetune import cli  # imported before forking: the child starts warm

    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, as a shell job would be
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        for sig in (signal.SIGTERM, signal.SIGINT):  # what a fresh interpreter has, whatever pytest set
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        os.environ.update(env or {})
        if before:
            before()
        if threads:
            import torch

            torch.set_num_threads(threads)
        code = cli.main(list(argv))
    except BaseException:  # noqa: BLE001 - a child must never return into pytest
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def spawn_cli(args: list[str], log: Path, env: dict | None = None, launcher: list[str] | None = None):
    """Popen of `python -m finetune ARGS` (or `launcher + ARGS`) in a new session, output to `log`."""
    cmd = (launcher or [sys.executable, "-m", "finetune"]) + list(args)
    out = open(log, "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)


def exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


_reaped: dict[int, int] = {}


def alive(pid: int) -> bool:
    """Whether a forked child still runs; reaps it when it has ended (see exit_code_of)."""
    if pid in _reaped:
        return False
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        _reaped[pid] = exit_code(status)
    return not done


def exit_code_of(pid: int) -> int:
    """Exit code of a child that `alive` saw end."""
    return _reaped.pop(pid)


def wait_pid(pid: int, timeout: float) -> int:
    """Exit code of a forked child (negative: killed by that signal); kills it and raises on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if not alive(pid):
            return exit_code_of(pid)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"process {pid} still running after {timeout} s")
        time.sleep(0.01)


def end_child(pid: int) -> None:
    """SIGKILL and reap a forked child if it still runs (its test failed while it ran)."""
    try:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except ChildProcessError:  # already reaped
        pass
    _reaped.pop(pid, None)


def wait_for_first_metrics(run_dir: Path, is_running, timeout: float = 300, min_step: int = 1) -> float:
    """Block until metrics.jsonl holds a complete record of a step >= min_step (training has taken a
    step, or a resumed run a new one); returns the monotonic time then."""
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_text(errors="replace").split("\n")[:-1]  # complete lines only
            if any(json.loads(line).get("step", 0) >= min_step for line in lines if line.strip()):
                return time.monotonic()
        if not is_running():
            raise RuntimeError(f"the run ended before a metrics line of step {min_step} ({run_dir})")
        time.sleep(0.005)
    raise TimeoutError(f"no metrics line in {timeout} s ({run_dir})")


def last_metrics_step(run_dir: Path) -> int:
    """The step of the newest complete record in metrics.jsonl (0: none yet)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text(errors="replace").split("\n")[:-1] if path.exists() else []
    return max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=0)


def trained_steps(log_text: str) -> list[int]:
    """The steps a run's output shows it trained (its printed metrics lines with a loss; log_every 1): for a
    resumed run exactly the steps after its checkpoint, for a run that started over every step again."""
    return [int(n) for n in re.findall(r"^step=(\d+) .*\bloss=", log_text, re.MULTILINE)]


def rank_processes(launcher_pid: int) -> dict:
    """{LOCAL_RANK: psutil.Process} of the workers a launcher (accelerate launch / torchrun) started."""
    import psutil

    out = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "LOCAL_RANK" in env and child.pid != launcher_pid:
            out[int(env["LOCAL_RANK"])] = child
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _read_until(fd: int, marker: bytes, deadline: float) -> bytes:
    import select

    got = b""
    while not got.endswith(marker):
        assert time.monotonic() < deadline, f"no {marker!r} from the command; got {got!r}"
        if select.select([fd], [], [], 1.0)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            got += chunk
    return got


def pty_chat(args: list[str], turns: list[str], env: dict, timeout: float = 240) -> tuple[list[str], str, int]:
    """`python -m finetune chat ARGS` on a pseudo-terminal (stdin, stdout and stderr, as a terminal gives them):
    types each of `turns` at its `you> ` prompt, then /exit. Returns (each turn's answer as shown, with its line
    end; the whole transcript; the exit code)."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "finetune", "chat", *args], stdin=slave, stdout=slave,
                            stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    deadline = time.monotonic() + timeout
    answers, transcript = [], _read_until(master, b"you> ", deadline).decode()
    try:
        for turn in turns:
            os.write(master, turn.encode() + b"\n")
            seen = _read_until(master, b"you> ", deadline).decode().replace("\r\n", "\n")
            transcript += seen
            assert seen.startswith(turn + "\n"), seen  # the terminal echoes the line typed
            answers.append(seen[len(turn) + 1: -len("you> ")])
        os.write(master, b"/exit\n")
        transcript += _read_until(master, b"\n", deadline).decode()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return answers, transcript, code
