"""scripts/test_durations.py over a durations file as tests/durations.py writes it: the sums per module and per
fixture, and the machine-speed line."""
import json

from scripts import test_durations as D
from tests.durations import probe


def _file(tmp_path, probe_s=None):
    tests = {
        "tests/a.py::t1": {"setup": 2.0, "call": 1.0, "teardown": 0.5, "outcome": "passed", "worker": "gw0",
                           "fixtures": [["big", "session", 1.5]]},
        "tests/a.py::t2": {"setup": 0.0, "call": 4.0, "teardown": 0.0, "outcome": "passed", "worker": "gw1",
                           "fixtures": []},
        "tests/b.py::t3": {"setup": 0.25, "call": 0.25, "teardown": 0.0, "outcome": "failed", "worker": "gw1",
                           "fixtures": [["big", "session", 0.25]]},
    }
    data = {"wall_s": 5.0, "workers": ["gw0", "gw1"], "tests": tests}
    if probe_s:
        data["probe_s"] = probe_s
    path = tmp_path / "durations.json"
    path.write_text(json.dumps(data))
    return path


def test_sums_per_module_and_fixture_and_the_machine_speed(tmp_path, capsys):
    probe_s = {"start": {"python_loop": 0.05, "matmul": 0.1}, "end": {"python_loop": 0.09, "matmul": 0.25}}
    assert D.main([str(_file(tmp_path, probe_s)), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "3 tests, 8 s of test time in 5 s of wall time, workers: gw0, gw1" in out
    assert "python_loop 0.050 at the start and 0.090 at the end, matmul 0.100 at the start and 0.250 at the end" in out
    assert D.per_module(json.loads((tmp_path / "durations.json").read_text())["tests"]) == {
        "tests/a.py": 7.5, "tests/b.py": 0.5}
    assert "1.8           2  big (session)" in out  # 1.5 + 0.25 over two setups


def test_a_file_without_the_probe_still_reads_and_the_probe_times_a_loop(tmp_path, capsys):
    assert D.main([str(_file(tmp_path))]) == 0
    assert "machine speed" not in capsys.readouterr().out
    assert D.main([str(_file(tmp_path, {"start": 0.024, "end": 0.027}))]) == 0  # the probe's first form: a float
    assert "python_loop 0.024 at the start and 0.027 at the end" in capsys.readouterr().out
    speed = probe()
    assert set(speed) == {"python_loop", "matmul"} and all(0 < s < 10 for s in speed.values()), speed
