"""The dry run's commands started from one warm process, so each pays for its work and not for its imports.

    python -m benchmarks.gpu.warm serve SOCKET [M,..] # the server: imports the libraries (or M,..) once, forks
    python -m benchmarks.gpu.warm -m MODULE ARGS...  # `python -m MODULE ARGS...`, run in a fork of the server
    python -m benchmarks.gpu.warm SCRIPT ARGS...     # `python SCRIPT ARGS...` (the tests' 2-process workers)

On 2 CPU cores a dry-run command spends ~5 s importing torch, transformers, bitsandbytes, peft, accelerate and
datasets, and under a second on its tiny model: with some 40 commands the imports were most of the dry run.
The server (benchmarks/gpu/proof.py starts it for --dry-run and names its socket in FINETUNE_PROOF_WARM) imports
those libraries (not finetune: each command imports finetune's own modules itself, as a fresh one does) and
forks once per command. The fork takes the client's stdin, stdout, stderr, working directory, environment and
arguments, runs the module as `python -m` does, and ends as a fresh interpreter ends (atexit, threads, exit
code); the client forwards the signals it gets (SIGTERM, SIGINT, SIGHUP) and exits with the fork's status, so
a caller, torchrun included, sees an ordinary child. A client killed outright (a stage's cap) takes the fork's
process group with it. The client itself imports nothing heavy; where no server answers it runs the command
cold (exec). Never used on a GPU: there the stages run every command as a user does.

What a fork cannot take from the client is what the libraries read from the environment as they are imported
(the hub's cache and offline settings, torch's and CUDA's switches): a client whose such variables (IMPORT_ENV)
differ from the server's runs cold. What the imports printed (to stdout or stderr) is printed again at the
start of every command, so a command's output holds what a fresh interpreter's would (a warning on import
included). The server ends when the process that started it does. The test suite's run_cli uses the same
server (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys

ENV = "FINETUNE_PROOF_WARM"
PRELOAD = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "safetensors", "tokenizers")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Variables the preloaded libraries read at import (huggingface_hub's and datasets' paths and offline mode,
# transformers' verbosity, torch's and CUDA's switches, the thread pools), and the home their caches default
# under. What torchrun sets for its workers (TORCHELASTIC_*, TORCH_NCCL_ASYNC_ERROR_HANDLING) and
# TOKENIZERS_PARALLELISM are read at run time.
RUN_TIME_ENV = ("TORCHELASTIC_", "TORCH_NCCL_")
IMPORT_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_",
              "BNB_", "BITSANDBYTES_", "SAFETENSORS_", "PEFT_", "TRITON_", "XDG_", "LD_", "MKL_",
              "KMP_", "OPENBLAS_", "HOME", "PYTHONHASHSEED", "PYTHONSAFEPATH")
_SERVER_MAIN = None
_IMPORT_OUTPUT = (b"", b"")  # what the server's imports wrote to stdout and stderr, for every command to print


def _send(conn: socket.socket, obj, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(conn, [msg], fds)
    else:
        conn.sendall(msg)


def _recv(conn: socket.socket, with_fds: bool = False):
    fds: list[int] = []
    if with_fds:
        buf, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    else:
        buf = conn.recv(1 << 20)
    if not buf:
        return None, fds
    size = struct.unpack("!I", buf[:4])[0]
    buf = buf[4:]
    while len(buf) < size:
        more = conn.recv(size - len(buf))
        if not more:
            return None, fds
        buf += more
    return json.loads(buf), fds


# ------------------------------------------------------------------------------------------------ client

def _unbuffered() -> bool:
    """Whether this interpreter runs with -u (torchrun starts its workers so)."""
    return bool(getattr(sys.stdout, "write_through", False))


def client(argv: list[str]) -> int:
    """`-m MODULE ARGS` or `SCRIPT ARGS`: through the server when there is one, else exec'd cold."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: python -m benchmarks.gpu.warm -m MODULE ARGS... | SCRIPT ARGS... | serve SOCKET [MODULES]"
              f"\n\n{__doc__}")
        return 0
    if not argv or argv[0] == "-m" and len(argv) < 2 or argv[0].startswith("-") and argv[0] != "-m":
        sys.exit("usage: python -m benchmarks.gpu.warm -m MODULE ARGS... | SCRIPT ARGS... | serve SOCKET [MODULES]")
    stdio = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            stdio.append(fd)
        except OSError:  # a closed stdin: the fork gets /dev/null
            stdio.append(os.open(os.devnull, os.O_RDWR))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not os.environ.get(ENV):
            raise OSError("no server named")
        conn.connect(os.environ[ENV])
        _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": _unbuffered()}, stdio)
        reply, _ = _recv(conn)
        if reply is None:
            raise OSError("the server closed the connection")
        if "cold" in reply:
            raise OSError(reply["cold"])
    except OSError:  # no server, it is gone, or it was imported under another environment: nothing has run yet,
        # so the command starts cold
        conn.close()
        os.execv(sys.executable, [sys.executable, *(["-u"] if _unbuffered() else []), *argv])
    pid = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    reply, _ = _recv(conn)
    if reply is None:
        sys.exit("benchmarks.gpu.warm: the command's process ended without an exit status")
    code = reply["exit"]
    if code < 0:  # killed by a signal: end the same way, so the caller sees what it would have seen
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


# ------------------------------------------------------------------------------------------------ server

def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> dict:
    """Listen first (clients queue while the imports run), import, then fork a handler per connection.
    Returns only in a command's process, with its request."""
    global _IMPORT_OUTPUT
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    _IMPORT_OUTPUT = _captured(preload)
    listener.settimeout(1.0)
    while True:
        if os.getppid() != parent:  # whoever started the server is gone (a test run killed): so is the server
            os._exit(0)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            conn = None
        while True:  # reap handlers that are done
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if conn is None:
            continue
        conn.settimeout(None)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            return handle(conn)
        conn.close()


def _captured(preload: tuple[str, ...]) -> tuple[bytes, bytes]:
    """Import `preload` with file descriptors 1 and 2 going to files; returns what was written to each, also
    passed on to the server's own stdout and stderr."""
    import importlib
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            for name in preload:
                importlib.import_module(name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
        written = []
        for fd, f in zip((1, 2), (out, err)):
            f.seek(0)
            data = f.read()
            os.write(fd, data)
            written.append(data)
    return written[0], written[1]


def _import_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV) and not k.startswith(RUN_TIME_ENV)}


def handle(conn: socket.socket) -> dict:
    """In the handler: fork the command's process, tell the client its pid, and report how it ended; kill its
    process group if the client goes first. Returns only in the command's process. A client whose environment
    differs from the server's where the imports read it is told to run cold."""
    req, fds = _recv(conn, with_fds=True)
    if req is None:
        os._exit(0)
    ours, theirs = _import_env(os.environ), _import_env(req["env"])
    if ours != theirs:
        names = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        _send(conn, {"cold": "imported under another " + ", ".join(names)})
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
        return req
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([pidfd, conn], [], [])
        if pidfd in ready:
            break
        try:
            gone = conn.recv(1) == b""
        except OSError:
            gone = True
        if gone:  # the client was killed: so is the command, with whatever it started
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    try:
        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
    except OSError:
        pass
    os._exit(0)


def _pythonpath(env) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def run(req: dict) -> None:
    """In the command's process: become `python -m MODULE ARGS` in the client's place, then end as python does."""
    import atexit
    import importlib
    import runpy
    import threading
    import traceback
    import types
    import warnings

    os.chdir(req["cwd"])
    served = _pythonpath(os.environ)
    os.environ.clear()
    os.environ.update(req["env"])
    argv = req["argv"]
    script = None if argv[0] == "-m" else os.path.abspath(argv[0])
    module, args = (argv[1], argv[2:]) if script is None else (None, argv[1:])
    sys.argv = [module or argv[0], *args]
    # sys.path as the client's interpreter has it: what -m puts first (the working directory) or a script's
    # folder, then its PYTHONPATH
    first = req["cwd"] if script is None else os.path.dirname(script)
    sys.path[:] = [first, *_pythonpath(os.environ), *(p for p in sys.path[1:] if p not in served)]
    importlib.invalidate_caches()
    unbuffered = bool(req["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)
    if os.environ.get("PYTHONWARNINGS"):
        warnings._processoptions(os.environ["PYTHONWARNINGS"].split(","))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
    for fd, data in zip((1, 2), _IMPORT_OUTPUT):  # what a fresh interpreter would have printed on import
        if data:
            os.write(fd, data)
    global _SERVER_MAIN
    _SERVER_MAIN = sys.modules["__main__"]  # this module, run as __main__: kept alive while the command runs
    sys.modules["__main__"] = types.ModuleType("__main__")
    code = 0
    try:
        if script is None:
            runpy._run_module_as_main(module, alter_argv=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # The end of the interpreter, less the teardown of every module (1-2 s of CPU with torch loaded, and
    # nothing a command's output or files depend on): its non-daemon threads joined, atexit, stdio flushed.
    threading._shutdown()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        preload = tuple(m for m in argv[2].split(",") if m) if len(argv) > 2 else PRELOAD
        run(serve(argv[1], preload))  # serve returns in a command's process only, and run ends that process
    return client(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
