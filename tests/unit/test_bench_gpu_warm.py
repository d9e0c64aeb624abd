"""benchmarks/gpu/warm.py, the dry run's warm process: a command forked from it behaves, to its caller, as
`python -m MODULE` started fresh (output, exit status, working directory, environment and PYTHONPATH,
signals), a client killed outright takes the command with it, and without a server the command runs cold; what
the server's imports printed, each command prints; a client whose environment the imports would have read
differently runs cold. The servers here preload nothing heavy, so the test costs no torch import."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.gpu.warm import ENV

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''
import json, os, signal, sys, time
mode = sys.argv[1]
if mode == "show":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("WARM_TEST_VAR"),
                      "main": __name__, "forked": os.getsid(0) == os.getpid()}))
    print("to stderr", file=sys.stderr)
    sys.exit(7)
if mode == "wait":  # says it is ready, then waits for SIGTERM
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(3)))
    open(sys.argv[2], "w").write(str(os.getpid()))
    print("ready", flush=True)
    time.sleep(60)
if mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
'''


NOISY = """import sys
print("said on import, to stdout")
print("said on import, to stderr", file=sys.stderr)
"""


def _serve(preload: str):
    folder = Path(tempfile.mkdtemp(prefix="warm-test-"))
    sock = folder / "sock"
    (folder / "warm_noisy.py").write_text(NOISY)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{folder}"}
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.warm", "serve", str(sock), preload], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 30
    while not sock.exists() and time.time() < deadline:
        time.sleep(0.02)
    yield sock, p.pid
    p.terminate()
    p.wait(timeout=10)
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def server():
    yield from _serve("")


@pytest.fixture(scope="module")
def noisy_server():
    yield from _serve("warm_noisy")


def _client(tmp_path: Path, sock: Path | None, *args: str, **kw):
    (tmp_path / "warm_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "WARM_TEST_VAR": "from the client"}
    env.pop(ENV, None)
    if sock:
        env[ENV] = str(sock)
    return [sys.executable, "-m", "benchmarks.gpu.warm", "-m", "warm_probe", *args], dict(cwd=tmp_path, env=env, **kw)


def test_a_command_runs_as_python_m_would_in_the_clients_place(server, tmp_path):
    cmd, kw = _client(tmp_path, server[0], "show", "x y")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    assert p.returncode == 7 and p.stderr.strip() == "to stderr", p.stderr
    got = json.loads(p.stdout)
    # the module is found through the client's PYTHONPATH, which the server was not started with
    assert got == {"argv": ["show", "x y"], "cwd": str(tmp_path), "var": "from the client", "main": "__main__",
                   "forked": True}  # the server's fork leads a session of its own; a cold start does not


def test_a_script_runs_as_python_script_would(server, tmp_path):
    # the tests' 2-process workers run as scripts: argv[0] is the script, its folder leads sys.path (a sibling
    # module imports), it runs as __main__
    folder = tmp_path / "workers"
    folder.mkdir()
    (folder / "sibling.py").write_text("NAME = 'sibling'\n")
    (folder / "worker.py").write_text(
        "import json, os, sys\nimport sibling\n"
        "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'main': __name__, 'sibling': sibling.NAME,"
        " 'forked': os.getsid(0) == os.getpid()}))\nsys.exit(5)\n")
    cmd, kw = _client(tmp_path, server[0])
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu.warm", str(folder / "worker.py"), "a b"],
                       capture_output=True, text=True, timeout=60, **kw)
    assert p.returncode == 5, p.stderr
    assert json.loads(p.stdout) == {"argv": [str(folder / "worker.py"), "a b"], "path0": str(folder),
                                    "main": "__main__", "sibling": "sibling", "forked": True}


def test_signals_reach_the_command_and_its_end_reaches_the_caller(server, tmp_path):
    cmd, kw = _client(tmp_path, server[0], "wait", str(tmp_path / "pid"))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **kw)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert out.strip() == "got SIGTERM" and p.returncode == 3
    cmd, kw = _client(tmp_path, server[0], "die")
    assert subprocess.run(cmd, timeout=60, **kw).returncode == -signal.SIGKILL


def test_a_client_killed_outright_takes_its_command_with_it(server, tmp_path):
    cmd, kw = _client(tmp_path, server[0], "wait", str(tmp_path / "pid"))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **kw)
    assert p.stdout.readline().strip() == "ready"
    pid = int((tmp_path / "pid").read_text())
    assert pid != p.pid  # the command runs in the server's fork, not in the client
    p.kill()
    p.wait(timeout=30)
    deadline = time.time() + 30
    while Path(f"/proc/{pid}").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


def test_without_a_server_the_command_runs_cold(tmp_path):
    cmd, kw = _client(tmp_path, None, "show", "cold")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    assert p.returncode == 7 and json.loads(p.stdout)["argv"] == ["show", "cold"]
    assert json.loads(p.stdout)["forked"] is False
    cmd, kw = _client(tmp_path, tmp_path / "no-such-socket", "show", "cold")
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw).returncode == 7


def test_what_the_imports_printed_each_command_prints(noisy_server, tmp_path):
    cmd, kw = _client(tmp_path, noisy_server[0], "show", "x")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    assert p.returncode == 7 and json.loads(p.stdout.splitlines()[-1])["forked"] is True
    assert p.stdout.splitlines()[0] == "said on import, to stdout"
    assert p.stderr.splitlines() == ["said on import, to stderr", "to stderr"]


def test_a_client_whose_imports_would_read_another_environment_runs_cold(noisy_server, tmp_path):
    cmd, kw = _client(tmp_path, noisy_server[0], "show", "x")
    kw["env"]["HF_HOME"] = str(tmp_path / "hf")  # huggingface_hub reads it on import
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    assert p.returncode == 7 and json.loads(p.stdout)["forked"] is False and p.stderr.strip() == "to stderr"
    kw["env"]["TORCHELASTIC_RUN_ID"] = "x"  # read at run time: no reason to start cold
    kw["env"].pop("HF_HOME")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    assert json.loads(p.stdout.splitlines()[-1])["forked"] is True
