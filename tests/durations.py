"""Where the suite's time goes, kept in a file: `--durations-file PATH` writes every test's setup, call and
teardown seconds, and the seconds each fixture's setup took (charged to the test that first needed it), as
JSON. `scripts/test_durations.py PATH` sums them per module and per fixture.

Works with pytest-xdist: fixture times are measured where the fixture runs (a worker) and travel to the
controller on the setup report's `user_properties`, which xdist serializes with every report.

The file also holds how fast the machine was (`probe_s`): two fixed workloads (`probe`) timed at the start
and at the end of the run. On the 2-core machine one afternoon (2026-11-28) a tiny training run's step took
0.11 to 0.30 s with nothing else running, and two runs of the suite within an hour differed by a median 1.8x
per test: the host's other load, which the machine cannot see, changes its speed. The probe tells such runs
apart.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

_current: dict = {}  # the test whose setup is running now, and the fixtures it has set up so far


def probe() -> dict:
    """Seconds of two fixed single-threaded workloads, each the best of 3 (a moment's hiccup is not the
    machine): a Python loop, and fp32 matrix products through torch. They need not move together: one
    afternoon the products (and a training step with them) ran 2.3x slower while the loop kept its speed."""
    import torch

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(min(times), 4)

    def loop():
        x = 0
        for i in range(1_000_000):
            x += i

    a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"python_loop": best(loop), "matmul": best(lambda: [a @ a for _ in range(5)])}
    finally:
        torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--durations-file", metavar="PATH", default=None,
                     help="write each test's setup/call/teardown seconds and each fixture's setup seconds to "
                          "PATH (JSON; scripts/test_durations.py sums it)")


def pytest_configure(config):
    path = config.getoption("--durations-file")
    if path and not hasattr(config, "workerinput"):  # the controller (or a plain run) writes the file
        config.pluginmanager.register(DurationsFile(Path(path)), "finetune-durations-file")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _current.update(nodeid=item.nodeid, fixtures=[])
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    t0 = time.perf_counter()
    yield
    if _current:
        _current["fixtures"].append([fixturedef.argname, fixturedef.scope, round(time.perf_counter() - t0, 4)])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "setup" and _current.get("nodeid") == item.nodeid:
        outcome.get_result().user_properties.append(("fixture_setup", list(_current["fixtures"])))
        _current.clear()


class DurationsFile:
    def __init__(self, path: Path):
        self.path, self.tests, self.t0 = path, {}, time.time()
        self.probe_s = {"start": probe()}

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)  # xdist: the worker that ran it
        rec = self.tests.setdefault(report.nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0, "outcome": "passed",
                                                    "fixtures": [], "worker": node.gateway.id if node else "main"})
        rec[report.when] = round(report.duration, 4)
        if report.outcome != "passed" and rec["outcome"] == "passed":
            rec["outcome"] = report.outcome
        for key, value in report.user_properties:
            if key == "fixture_setup":
                rec["fixtures"] = value

    def pytest_sessionfinish(self, session):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        workers = sorted({t["worker"] for t in self.tests.values()})
        self.probe_s["end"] = probe()
        data = {"wall_s": round(time.time() - self.t0, 1), "workers": workers, "probe_s": self.probe_s,
                "tests": self.tests}
        self.path.write_text(json.dumps(data, indent=1) + "\n")

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line(f"per-test durations of {len(self.tests)} tests: {self.path} "
                                    f"(python scripts/test_durations.py {self.path})")
