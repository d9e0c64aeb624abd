"""`python -m benchmarks._child MODULE KWARGS_JSON`: run benchmarks.MODULE.run(**kwargs) (MODULE dotted below
benchmarks, e.g. cpu.throughput) in this fresh interpreter and print its result as one JSON line (the
orchestrator reads the last one)."""
from __future__ import annotations

import importlib
import json
import sys


def main(argv: list[str]) -> int:
    name, kwargs = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    try:
        module = importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"benchmarks.{name}":
            raise  # the row exists but something it needs does not: that is a failure, not absence
        print(json.dumps({"available": False, "reason": f"benchmarks/{name.replace('.', '/')}.py is not present"}))
        return 0
    print(json.dumps(module.run(**kwargs), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
