"""The package's shape (docs/architecture.md): layers import only downward, no import cycles, the planner and
the recipe never import torch, and modules and functions stay small. Imports inside functions count too."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "finetune"
# Highest first: a module may import its own package and the layers after it. Packages that share a layer
# (merge and train) are peers and import nothing from each other: the merge needs no training code.
LAYERS = ["cli", "commands", "gguf", ("merge", "train"), "artefacts", "weights", "data", "plan", "recipe", "util"]
TORCH_FREE = ("plan", "recipe")
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "trl", "safetensors")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def module_files(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every finetune module `name` imports, at top level or inside functions. `from a.b import c` counts as
    an import of a.b.c when that is a module, else of a.b."""
    top = name.split(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.split(".")[0] == top and t != name:
                found.add(t)
    return found


def external_imports(path: Path) -> set[str]:
    """Top-level names of the libraries a module imports anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def package(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package itself
    return "cli" if parts[1] in ("cli", "__main__") else parts[1]


def layer(module: str) -> int | None:
    key = package(module)
    if key is None:
        return None
    return next(i for i, entry in enumerate(LAYERS) if key == entry or (isinstance(entry, tuple) and key in entry))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer, or of a peer package in the same layer."""
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                  if layer(a) is not None and layer(b) is not None
                  and (layer(b) < layer(a) or (layer(b) == layer(a) and package(b) != package(a))))


@pytest.fixture(scope="module")
def graph():
    modules = module_files(PACKAGE)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_module_belongs_to_a_layer(graph):
    assert all(layer(m) is not None for m in graph if m != "finetune")


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_imports_point_only_downward(graph):
    assert upward(graph) == []


def test_merge_imports_nothing_from_train(graph):
    assert sorted(f"{a} -> {b}" for a, deps in graph.items() if package(a) == "merge"
                  for b in deps if package(b) == "train") == []


# The loader: what puts a base in memory and shards it. A training step needs none of it (the hot path stays
# readable and cheap to import; an edit to the loader cannot slow or break a step).
LOADER = ("finetune.weights.load", "finetune.weights.shard", "finetune.weights.built")


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


def test_the_step_imports_no_loader(graph):
    step = closure(graph, "finetune.train.step")
    assert {"finetune.train.loss", "finetune.train.precision", "finetune.data.transfer"} <= step  # the walk works
    assert sorted(m for m in step if m.startswith(LOADER)) == []

def private_names_defined(tree) -> set[str]:
    """Underscore names a module defines: functions, classes, and attributes it assigns (`self._x = ...`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def cross_module_private_uses(package: Path) -> list[str]:
    """`from finetune.x import _name`, and `obj._name` where `_name` is one of finetune's own private names
    defined only in other modules (a private function or attribute reached from outside its module)."""
    trees = {p: ast.parse(p.read_text()) for p in sorted(package.rglob("*.py"))}
    defined = {p: private_names_defined(t) for p, t in trees.items()}
    ours = set().union(*defined.values())
    found = []
    for path, tree in trees.items():
        rel = path.relative_to(package.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("finetune")):
                found += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Attribute) and node.attr in ours and node.attr not in defined[path]
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{rel}:{node.lineno} uses .{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    assert cross_module_private_uses(PACKAGE) == []


def test_one_name_per_thing():
    """No two modules share a file name (three modules named `load` once meant three things), except a verb in
    commands/ named as the layer module that does its work (commands/estimate.py -> plan/estimate.py)."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py" and path.parent.name != "commands":
            seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_planner_and_recipe_never_import_heavy_libraries():
    bad = {str(p.relative_to(ROOT)): sorted(external_imports(p) & set(HEAVY))
           for sub in TORCH_FREE for p in (PACKAGE / sub).rglob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_modules_and_functions_are_small():
    too_big = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        rel = path.relative_to(ROOT)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_big.append(f"{rel}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    too_big.append(f"{rel}:{node.lineno} {node.name}: {node.end_lineno - start + 1} lines")
    assert too_big == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The checkers themselves: a cycle, an upward import (inside a function) and a relative import."""
    pkg = tmp_path / "finetune"
    for sub in ("util", "plan"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "util" / "a.py").write_text("def f():\n    from finetune.plan import b\n")
    (pkg / "plan" / "b.py").write_text("from ..util import a\n")
    modules = module_files(pkg)
    g = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert g["finetune.plan.b"] == {"finetune.util.a"} and g["finetune.util.a"] == {"finetune.plan.b"}
    assert cycles(g) == [["finetune.plan.b", "finetune.util.a"]]
    assert upward(g) == ["finetune.util.a -> finetune.plan.b"]
    (pkg / "merge").mkdir()
    (pkg / "train").mkdir()
    (pkg / "merge" / "m.py").write_text("from finetune.train import t\n")
    (pkg / "train" / "t.py").write_text("")
    modules = module_files(pkg)
    g = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "finetune.merge.m -> finetune.train.t" in upward(g)
    # Private names: imported from another module, or reached on an object from outside the defining module.
    (pkg / "util" / "c.py").write_text("class C:\n    def _hidden(self):\n        self._state = 1\n\n\ndef _helper():\n    pass\n")
    (pkg / "plan" / "d.py").write_text("from finetune.util.c import _helper\n\n\ndef g(c):\n    return c._hidden()\n")
    (pkg / "plan" / "e.py").write_text("def h(lib):\n    return lib._not_ours\n")  # a library's: the private-API table's job
    assert cross_module_private_uses(pkg) == ["finetune/plan/d.py:1 imports _helper", "finetune/plan/d.py:5 uses ._hidden"]
    assert closure(g, "finetune.merge.m") == {"finetune.merge.m", "finetune.train.t"}


def test_help_and_planning_answer_without_heavy_imports():
    code = ("import sys; from finetune import cli; cli.main(['--help']); "
            "cli.main(['estimate', 'recipes/llama3_70b_qlora.yaml', '--gpus', '2']); "
            # a mistyped argument of a verb that loads a model is refused before torch is imported
            "codes = [cli.main(['generate', 'runs/x', '--prompt', 'hi', '--seed', '-1']), "
            "cli.main(['chat', 'runs/x', '--temperature', 'nan']), cli.main(['eval', 'runs/x', '--max-rows', '-1']), "
            # and so is a run dir that is not a finished run (train/runcheck.py)
            "cli.main(['eval', 'runs/no-such-run']), cli.main(['generate', 'runs/no-such-run', '--prompt', 'hi'])]; "
            "assert codes == [2] * 5, codes; "
            "assert not {'torch', 'transformers', 'peft'} & set(sys.modules), 'heavy import'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "validate" in out.stdout and "GPU memory per device" in out.stdout
    assert "--seed must be 0 to 2^32-1" in out.stderr and "--max-rows must be >= 0" in out.stderr
    assert out.stderr.count("runs/no-such-run: not a finished run dir") == 2, out.stderr


def repository_graph(root: Path) -> dict[str, set[str]]:
    """Every package at the repository's top (finetune, benchmarks, tests, ...) and what each module imports
    from any of them, inside functions too: cycles can run across packages, so one graph holds them all."""
    modules = {}
    for init in sorted(root.glob("*/__init__.py")):
        modules.update(module_files(init.parent))
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue  # relative imports stay inside one package, which imports_of's graph already checks
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
        graph[name] = found
    return graph


def test_no_import_cycle_anywhere_in_the_repository(tmp_path):
    """benchmarks/ once held the repository's only cycles; this holds every top-level package to it."""
    graph = repository_graph(ROOT)
    assert {"benchmarks.gpu.stages", "benchmarks.cpu.report"} <= set(graph), "benchmarks/ is not in the graph"
    assert cycles(graph) == []
    for pkg, body in (("a", "from b import y\n"), ("b", "def f():\n    from a.x import g\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / ("x.py" if pkg == "a" else "y.py")).write_text(body)
    assert cycles(repository_graph(tmp_path)) == [["a.x", "b.y"]]
