"""Sum a test run's durations file (pytest --durations-file PATH) per module and per fixture.

    python scripts/test_durations.py .ci/out/durations.json [--top 10] [--compare OTHER.json]

Per module: the seconds of its tests' setup, call and teardown. Per fixture: the seconds its setups took (a
session fixture once per process that needed it: with pytest-xdist, once per worker). With --compare, the
modules side by side with another run's file (before/after)."""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) and isinstance(data.get("tests"), dict) else {}
    except (OSError, ValueError) as e:
        sys.exit(f"error: {path}: {e}")


def total(rec: dict) -> float:
    return rec["setup"] + rec["call"] + rec["teardown"]


def per_module(tests: dict) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for nodeid, rec in tests.items():
        out[nodeid.split("::")[0]] += total(rec)
    return dict(out)


def per_fixture(tests: dict) -> dict[str, tuple[float, int]]:
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for rec in tests.values():
        for name, scope, seconds in rec.get("fixtures", []):
            out[f"{name} ({scope})"][0] += seconds
            out[f"{name} ({scope})"][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def table(title: str, rows: list[tuple], head: tuple) -> str:
    lines = [title, "  " + "  ".join(f"{h:>10}" for h in head[:-1]) + f"  {head[-1]}"]
    lines += ["  " + "  ".join(f"{c:>10}" for c in r[:-1]) + f"  {r[-1]}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="the JSON that pytest --durations-file wrote")
    ap.add_argument("--top", type=int, default=10, help="rows of each table (default 10)")
    ap.add_argument("--compare", type=Path, help="another run's file: modules before (that file) and after (PATH)")
    a = ap.parse_args(argv)
    data = load(a.path)
    if not data:
        print(f"error: {a.path} is not a durations file (pytest --durations-file)", file=sys.stderr)
        return 2
    tests = data["tests"]
    busy = sum(total(r) for r in tests.values())
    print(f"{len(tests)} tests, {busy:.0f} s of test time in {data.get('wall_s', 0):.0f} s of wall time, "
          f"workers: {', '.join(data.get('workers', [])) or 'one'}")
    probe = data.get("probe_s")
    if probe:  # tests/durations.py: the machine's speed, which varies with load the machine cannot see
        # a float: the first form of the probe, its Python loop alone
        start, end = ({"python_loop": v} if isinstance(v, (int, float)) else (v or {})
                      for v in (probe.get("start"), probe.get("end")))
        print("machine speed (tests/durations.py probe; seconds, lower is faster; compare runs by it): "
              + ", ".join(f"{k} {start.get(k, 0):.3f} at the start and {end.get(k, 0):.3f} at the end" for k in start))
    print()
    slow = sorted(tests.items(), key=lambda kv: -total(kv[1]))[:a.top]
    print(table(f"slowest {a.top} tests", [(f"{total(r):.1f}", f"{r['setup']:.1f}", n) for n, r in slow],
                ("seconds", "setup", "test")))
    mods = sorted(per_module(tests).items(), key=lambda kv: -kv[1])[:a.top]
    print()
    if a.compare:
        before = per_module(load(a.compare).get("tests", {}))
        print(table(f"slowest {a.top} modules, before ({a.compare}) and after", 
                    [(f"{before.get(m, 0):.1f}", f"{s:.1f}", m) for m, s in mods], ("before", "after", "module")))
    else:
        print(table(f"slowest {a.top} modules", [(f"{s:.1f}", m) for m, s in mods], ("seconds", "module")))
    fx = sorted(per_fixture(tests).items(), key=lambda kv: -kv[1][0])[:a.top]
    print()
    print(table(f"slowest {a.top} fixtures (setup seconds, summed over the tests that set them up)",
                [(f"{s:.1f}", n, name) for name, (s, n) in fx], ("seconds", "setups", "fixture")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
