import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The workers share the machine's cores: one compute thread each, in this process and every process it
    # starts (set before torch is imported; tests that compare runs already pin OMP_NUM_THREADS=1).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# `finetune train` sets HF_HUB_OFFLINE=1 before the hub's library is imported (finetune/commands/train.py); the
# suite's in-process training would set it part way through the run, so it is set from the start: the warm
# process (run_cli) then imports as a training command does, and the commands' environment stays the one it
# imported under. A fresh interpreter (run_cli's fresh=True) starts without it, as a user's shell does.
USER_HAS_OFFLINE = "HF_HUB_OFFLINE" in os.environ
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The environment the suite started with: the warm process imports under it, whatever a test that happens to
# start it has patched (a server started under a test's HF_HOME would send every later command cold).
START_ENV = dict(os.environ)

pytest_plugins = ["tests.durations"]  # --durations-file: where the suite's time goes (CI keeps it)


def once_per_run(tmp_path_factory, name: str, build) -> Path:
    """A directory that `build(path)` fills once per pytest run, for the expensive runs whose results many
    tests only read. Under pytest-xdist every worker has its own session, so the first worker to ask builds it
    under a file lock in the directory the workers share, and the others wait for it and read the same files.
    A build that raises leaves nothing marked done: the next asker builds again (and fails the same way)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-USER/pytest-N/: one per run, shared by its workers
    path, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir():
    from finetune.util import builtin as tiny

    return tiny.model_dir()


@pytest.fixture(scope="session")
def tiny_data_dir():
    from finetune.util import builtin as tiny

    return tiny.dataset_dir()


def run_cli(args, cwd=None, timeout=600, env=None, fresh=False, input=None):
    """Run `python -m finetune ...` in a subprocess; returns CompletedProcess with text output.

    The command runs in a fork of this worker's warm process (benchmarks/gpu/warm.py), which imported torch,
    transformers, peft, bitsandbytes, accelerate and datasets once: ~5 s of CPU saved per command, the largest
    share of a tiny run. To the test it is `python -m finetune ARGS` (output, exit code, working directory,
    environment; what the imports print is printed again). It runs cold where the libraries would read the
    environment differently at import (HF_HOME and the like), and with `fresh=True`: for the checks whose
    subject is a fresh interpreter (what a first run prints, what `--help` imports). FINETUNE_TESTS_COLD=1 runs
    every command cold (to rule the warm process out when a test fails)."""
    import subprocess

    e = dict(os.environ)
    if fresh and not USER_HAS_OFFLINE:
        e.pop("HF_HUB_OFFLINE", None)
    e.update(env or {})
    cmd = [sys.executable, "-m", "finetune", *args]
    sock = None if fresh or os.environ.get("FINETUNE_TESTS_COLD") == "1" else _warm_server()
    if sock:
        from benchmarks.gpu.warm import ENV

        e[ENV] = str(sock)
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "warm.py"), "-m", "finetune", *args]
    return subprocess.run(cmd, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout, env=e, input=input)


def warm_launch(cmd, env=None):
    """A multi-process launch, `python -m accelerate.commands.launch|torch.distributed.run FLAGS -m MODULE ARGS`
    (or FLAGS and a worker script with its ARGS), with its launcher and each rank forked from this worker's warm process as
    run_cli forks one command: returns (command, environment). The launcher's flags stay as given; each rank's
    script becomes `benchmarks/gpu/warm.py -m MODULE ARGS` (or warm.py before the worker script), a client that forwards
    its signals and exit status, so to the launcher it is an ordinary child. Tests whose subject is a process
    (a killed launcher, a dying rank, `accelerate launch` as a user types it) launch cold, as does every launch
    under FINETUNE_TESTS_COLD=1."""
    e = dict(os.environ if env is None else env)
    sock = None if os.environ.get("FINETUNE_TESTS_COLD") == "1" else _warm_server()
    if sock is None:
        return list(cmd), e
    from benchmarks.gpu.warm import ENV

    assert cmd[1] == "-m" and cmd[2] in ("accelerate.commands.launch", "torch.distributed.run"), cmd
    # where the rank's command starts: the launcher's `-m MODULE`, or its worker script
    at = next(i for i in range(3, len(cmd)) if cmd[i] == "-m" or cmd[i].endswith(".py"))
    e[ENV] = str(sock)
    warm = str(ROOT / "benchmarks" / "gpu" / "warm.py")
    return [cmd[0], warm, "-m", cmd[2], *cmd[3:at], warm, *cmd[at:]], e


WARM_PRELOAD = ("finetune.util.log",  # first, as the CLI imports it first: it quiets a bitsandbytes import notice
                "torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "safetensors", "tokenizers")
_warm = {}


def _warm_server():
    """The socket of this process's warm server, started on first use (it imports while the first command
    waits on its socket) and ended with the process; None where it does not come up (commands run cold)."""
    if "sock" not in _warm:
        import atexit
        import shutil
        import subprocess
        import tempfile
        import time

        from benchmarks.gpu.warm import ENV

        folder = Path(tempfile.mkdtemp(prefix="warm-"))  # short: a socket's path holds at most 107 bytes
        sock = folder / "sock"
        env = {k: v for k, v in START_ENV.items() if k != ENV}
        with open(folder / "log", "w") as log:  # what its imports print (each command prints it again)
            p = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.warm", "serve", str(sock),
                                  ",".join(WARM_PRELOAD)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        deadline = time.time() + 30
        while not sock.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        _warm["sock"] = sock if sock.exists() else None

        def stop():
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
            shutil.rmtree(folder, ignore_errors=True)

        atexit.register(stop)
    return _warm["sock"]


@pytest.fixture(scope="session")
def tok():
    """The builtin tiny tokenizer, straight from the assets (tests that need another define their own)."""
    from transformers import AutoTokenizer

    from finetune.util import builtin as tiny

    return AutoTokenizer.from_pretrained(tiny.ASSETS / f"tiny-llama-{tiny.VERSION}")
