"""Every private library use in finetune/ has its row in docs/architecture.md's table ("Private library
internals": what breaks, which test pins it), and every row names a use that still exists. The rule is the
comment below; the pins of each row's library behaviour are in test_private_apis.py."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "finetune"
PAGE = ROOT / "docs" / "architecture.md"

# Every private library use has its row in docs/architecture.md ("Private library internals"), and every row
# names a use that still exists. The rule (what counts as a private use), over every finetune/**/*.py:
#   1. an import from one of LIBRARIES of an underscore module or name (`from torch.distributed.fsdp import
#      _init_utils`), or of a name in KNOWN_PRIVATE;
#   2. `x._name` read (or getattr/hasattr with the literal "_name") where `_name` is not ours: not the name of a
#      def or class anywhere in finetune/, nor assigned at module level or in a class body (pydantic private
#      attributes, dataclass fields); on `self`/`cls` an attribute our code assigns (`self._name = ...`) is
#      ours too. Dunders are not private;
#   3. `x._name = ...` (or `del`, or setattr with "_name") on anything but `self`/`cls`: writing another
#      object's private state, even one of ours (a pydantic private attribute written from outside);
#   4. an assignment to (or `del` of) `.forward`, `.__class__` or `.__dict__` on anything, or setattr with
#      those names, or any `object.__setattr__`: a library object's behaviour or identity swapped;
#   5. an assignment to an attribute of a name imported from one of LIBRARIES (a library's function, class
#      attribute or module global replaced, even for the length of a `with`);
#   6. a custom operator called through `torch.ops.<namespace>.<op>` (a library's registered op, by schema);
#   7. the public-looking names of KNOWN_PRIVATE wherever they appear (attribute, name, keyword argument,
#      method override, getattr string), and the attributes of KNOWN_WRITES written on anything but `self`.
# A use is keyed (module path relative to finetune/, name); a row covers it when its "where" cell names the
# module in backticks and its "private use" cell names the identifier in backticks (alone or inside a dotted
# or called expression: `torch.cuda.memory._record_memory_history` covers `_record_memory_history`).
LIBRARIES = frozenset({"torch", "transformers", "peft", "accelerate", "bitsandbytes", "pydantic", "safetensors",
                       "trl", "datasets", "huggingface_hub", "gguf", "llama_cpp",
                       "conversion"})  # conversion: llama.cpp's converter package (gguf/llama_shim.py)
SWAPPED = frozenset({"forward", "__class__", "__dict__"})
# Private though public-looking: no underscore, but not part of the library's documented API.
KNOWN_PRIVATE = {
    "get_pattern_key": "peft.utils.other's module-pattern matcher; peft does not export it",
    "get_keys_to_not_convert": "transformers.quantizers.base helper of its quantizers' loading",
    "should_convert_module": "transformers.quantizers.quantizers_utils helper of its quantizers' loading",
    "CONFIG_MAPPING_NAMES": "transformers.models.auto.configuration_auto's table (the public one is CONFIG_MAPPING)",
    "preprocess_model": "HfQuantizer's hook that from_pretrained calls (swaps nn.Linear for Linear4bit)",
    "postprocess_model": "HfQuantizer's hook that from_pretrained calls after the weights are in",
    "hf_quantizer": "the attribute from_pretrained sets on a quantized model, read by transformers and peft",
    "bnb_quantized": "Params4bit's keyword saying its data is packed already (with module=, the Linear4bit)",
    "support_avx512bf16_for_cpu": "Linear4bit's switch for its CPU weight repacking",
    "optimizer_update_32bit": "bitsandbytes.functional's kernel wrapper under its optimizers",
    "optimizer_update_8bit_blockwise": "bitsandbytes.functional's kernel wrapper under its optimizers",
    "init_state": "bitsandbytes Optimizer8bit's per-parameter hook (overridden)",
    "update_step": "bitsandbytes Optimizer8bit's per-parameter hook (overridden)",
    "get_config": "bitsandbytes Optimizer8bit's per-parameter config",
    "get_state_buffer": "bitsandbytes Optimizer8bit's state allocator",
    "name2qmap": "bitsandbytes Optimizer8bit's quantization maps",
    "ParamWrapper": "peft.tuners.lora.layer's wrapper of nn.Parameter targets, not exported",
    "ds_shape": "the DeepSpeed-partitioned shape peft sizes adapters from",
    "get_delta_factors": "peft ParamWrapper's per-expert factors, undocumented",
}
# Public attributes that are another object's (Accelerate's shared state) when written from outside it.
KNOWN_WRITES = frozenset({"distributed_type", "fsdp_plugin", "device"})
SELF = frozenset({"self", "cls"})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _finetune_imports(name: str, tree: ast.AST, modules: set[str]) -> set[str]:
    """The finetune modules (dotted) that module `name` imports, anywhere in it."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[:len(name.split(".")) - node.level]
                base = ".".join(package + ([node.module] if node.module else []))
            bases = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {b for b in bases if b in modules}
    return out


def _assigned(body: list[ast.stmt]) -> set[str]:
    """Names these statements assign (module level, or a class body)."""
    out = set()
    for stmt in body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
            stmt, (ast.AnnAssign, ast.AugAssign)) else []
        out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def ours(trees: dict[str, ast.AST]) -> dict[str, tuple[set[str], set[str]]]:
    """{module: (names ours on any receiver there, attributes ours on `self`/`cls` there)}. A name is ours in a
    module when that module, or a finetune module it imports or that imports it, defines it: as a def or class,
    by an assignment at module level or in a class body (pydantic private attributes, dataclass fields), or,
    for `self`/`cls` only, by `self._name = ...`."""
    own = {}
    for key, tree in trees.items():
        defined, on_self = _assigned(tree.body), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                defined |= _assigned(node.body)
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in SELF):
                on_self.add(node.attr)
        own[key] = defined, on_self
    dotted = {key: "finetune." + key[:-3].replace("/", ".").removesuffix(".__init__") for key in trees}
    by_dotted = {v: k for k, v in dotted.items()}
    near = {key: {key} for key in trees}
    for key, tree in trees.items():
        for other in _finetune_imports(dotted[key], tree, set(by_dotted)):
            near[key].add(by_dotted[other])
            near[by_dotted[other]].add(key)
    return {key: (set().union(*(own[k][0] for k in near[key])), set().union(*(own[k][1] for k in near[key])))
            for key in trees}


def _receiver(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def private_uses(tree: ast.AST, defined: set[str], on_self: set[str]) -> dict[str, list[int]]:
    """{name: [lines]} of one module's private library uses (the rule above)."""
    found: dict[str, list[int]] = {}

    def add(name, node):
        found.setdefault(name, []).append(node.lineno)

    imported = set()  # local names bound to something of LIBRARIES
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    imported.add((a.asname or a.name).split(".")[0])
                    for part in a.name.split("."):
                        if _is_private(part):
                            add(part, node)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in LIBRARIES:
            for part in node.module.split("."):
                if _is_private(part):
                    add(part, node)
            for a in node.names:
                imported.add(a.asname or a.name)
                if _is_private(a.name) or a.name in KNOWN_PRIVATE:
                    add(a.name, node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            recv, store = _receiver(node.value), isinstance(node.ctx, (ast.Store, ast.Del))
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if node.attr in KNOWN_PRIVATE or (store and node.attr in SWAPPED):
                add(node.attr, node)
            elif _is_private(node.attr):
                if (store and recv not in SELF) or node.attr not in defined | (on_self if recv in SELF else set()):
                    add(node.attr, node)
            elif store and ((recv not in SELF and node.attr in KNOWN_WRITES) or _receiver(root) in imported):
                add(node.attr, node)
            dotted = ast.unparse(node.value)
            if dotted.startswith("torch.ops.") and dotted.count(".") == 2:
                add(node.attr, node)
        elif isinstance(node, ast.Name) and node.id in KNOWN_PRIVATE:
            add(node.id, node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in KNOWN_PRIVATE:
            add(node.name, node)
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in KNOWN_PRIVATE:
                    add(kw.arg, kw)
            fn = node.func.id if isinstance(node.func, ast.Name) else None
            name = _string(node.args[1]) if len(node.args) >= 2 else None
            if ast.unparse(node.func) == "object.__setattr__":
                add("__setattr__", node)
            elif fn in ("getattr", "hasattr", "setattr", "delattr") and name:
                recv, write = _receiver(node.args[0]), fn in ("setattr", "delattr")
                mine = defined | (on_self if recv in SELF else set())
                if (name in KNOWN_PRIVATE or (write and name in SWAPPED)
                        or (_is_private(name) and ((write and recv not in SELF) or name not in mine))):
                    add(name, node)
    return found


def package_uses(package: Path = PACKAGE) -> dict[tuple[str, str], list[int]]:
    """{(module relative to the package, name): lines} of every private library use in the package."""
    trees = {str(p.relative_to(package)): ast.parse(p.read_text()) for p in sorted(package.rglob("*.py"))}
    names = ours(trees)
    return {(module, name): sorted(set(lines)) for module, tree in trees.items()
            for name, lines in private_uses(tree, *names[module]).items()}


def table_rows(page: Path = PAGE) -> list[dict]:
    """The rows of the page's "Private library internals" table: {line, modules, names, breaks, pinned}."""
    text = page.read_text(encoding="utf-8")
    section = text.split("\n## Private library internals\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line not in section.splitlines() or not line.startswith("| ") or line.startswith(("| where", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"docs/architecture.md:{number}: a row has 4 cells (where | private use | " \
                                f"what breaks | pinned by): {line}"
        rows.append({"line": number, "modules": re.findall(r"`([\w/]+\.py)`", cells[0]),
                     "names": {w for tick in re.findall(r"`([^`]+)`", cells[1]) for w in re.findall(r"\w+", tick)},
                     "breaks": cells[2], "pinned": re.findall(r"`(tests/[\w/]+\.py)::(\w+)[^`]*`", cells[3])})
    return rows


def table_problems(uses: dict[tuple[str, str], list[int]], rows: list[dict], root: Path = ROOT) -> list[str]:
    """What keeps the table from being the true list of `uses`: a use without its row, a row naming a use or a
    module that is not there (any more), a row without what breaks or without an existing test that pins it."""
    problems = []
    for (module, name), lines in sorted(uses.items()):
        if not any(module in r["modules"] and name in r["names"] for r in rows):
            problems.append(f"finetune/{module}:{','.join(map(str, lines))} uses `{name}` but no row of "
                            f"docs/architecture.md's private-API table names `{module}` in its where cell and "
                            f"`{name}` in its private-use cell: add it to the row for that use, or add a row")
    scanned = {name for _, name in uses} | set(KNOWN_PRIVATE) | SWAPPED
    for r in rows:
        where = f"docs/architecture.md:{r['line']}"
        if not r["modules"]:
            problems.append(f"{where}: its where cell names no module (`path/relative/to/finetune.py`)")
        for module in r["modules"]:
            if not any((module, name) in uses for name in r["names"]):
                problems.append(f"{where}: stale: `{module}` uses none of the row's names any more "
                                f"({sorted(n for n in r['names'] if n in scanned or _is_private(n))}); "
                                f"finetune/{module} {'exists' if (root / 'finetune' / module).exists() else 'is gone'}")
        for name in sorted(r["names"]):
            if (name in scanned or _is_private(name)) and not any((m, name) in uses for m in r["modules"]):
                elsewhere = sorted(m for m, n in uses if n == name)
                problems.append(f"{where}: stale: `{name}` is not used in {r['modules']}"
                                + (f" (it is in {elsewhere}: update the where cell)" if elsewhere else ""))
        if not r["breaks"]:
            problems.append(f"{where}: no 'what breaks when the library changes'")
        if not r["pinned"]:
            problems.append(f"{where}: no test pins it (`tests/...py::test_name` in the last cell)")
        for path, test in r["pinned"]:
            file = root / path
            if not file.exists() or not re.search(rf"^def {test}\(", file.read_text(encoding="utf-8"), re.MULTILINE):
                problems.append(f"{where}: pinned by `{path}::{test}`, which does not exist")
    return problems


def test_every_private_use_has_its_row():
    """docs/architecture.md's private-API table is the list of the package's private library uses, both ways."""
    problems = table_problems(package_uses(), table_rows())
    assert not problems, "\n" + "\n".join(problems)


def test_the_private_use_finder_finds_each_kind(tmp_path):
    """The rule, on a package written for it: each kind is found once, ours and public uses are not."""
    pkg = tmp_path / "finetune"
    pkg.mkdir()
    (pkg / "own.py").write_text(
        "X_ = 1\n_TABLE = {}\n\nclass Spec:\n    _flag: bool = False\n\n    def _helper(self):\n"
        "        self._cache = 1\n        return self._cache, self._helper(), self._parameters\n\n"
        "def _build():\n    return _TABLE\n")
    (pkg / "use.py").write_text(
        "import torch\nimport datasets.config\nfrom torch.distributed.fsdp import _init_utils\n"
        "from peft.utils.other import get_pattern_key\nfrom conversion.base import TextModel\n"
        "from finetune import own\n\n"
        "def f(model, spec, state, head, t):\n"
        "    own._build(); spec._helper()\n"  # ours: a module function, a method of a class of an imported module
        "    model.config._attn_implementation\n"  # a library's private attribute
        "    getattr(model, '_no_split_modules', None)\n"
        "    spec._flag = True\n"  # ours, written from outside the object
        "    head.forward = len\n    del head.forward\n    t.__class__ = type(t)\n"
        "    object.__setattr__(t, 'x', 1)\n    setattr(model, 'forward', len)\n"
        "    datasets.config.HF_HUB_OFFLINE = True\n    TextModel.get_vocab_base_pre = len\n"
        "    torch.ops.bitsandbytes.quantize_4bit.default(A=t)\n"
        "    torch.nn.Parameter(t, bnb_quantized=True)\n    state.fsdp_plugin = None\n"
        "    torch.cuda.memory._snapshot()\n    model.save_pretrained('x')\n")
    found = package_uses(pkg)
    assert found == {
        ("own.py", "_parameters"): [9], ("use.py", "_init_utils"): [3], ("use.py", "get_pattern_key"): [4],
        ("use.py", "_attn_implementation"): [10], ("use.py", "_no_split_modules"): [11], ("use.py", "_flag"): [12],
        ("use.py", "forward"): [13, 14, 17], ("use.py", "__class__"): [15], ("use.py", "__setattr__"): [16],
        ("use.py", "HF_HUB_OFFLINE"): [18], ("use.py", "get_vocab_base_pre"): [19], ("use.py", "quantize_4bit"): [20],
        ("use.py", "bnb_quantized"): [21], ("use.py", "fsdp_plugin"): [22], ("use.py", "_snapshot"): [23]}
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_pin():\n    pass\n")
    page = tmp_path / "page.md"
    page.write_text("# x\n\n## Private library internals\n\n| where | private use | what breaks | pinned by |\n"
                    "|---|---|---|---|\n"
                    "| `use.py` | `model.config._attn_implementation`, `torch.cuda.memory._snapshot` | packing | "
                    "`tests/test_x.py::test_pin` |\n"
                    "| `gone.py`, `use.py` | `get_pattern_key`, `_old_name` | | `tests/test_x.py::test_none` |\n"
                    "\n## Next\n")
    problems = table_problems({k: v for k, v in found.items() if k[1] in (
        "_attn_implementation", "_snapshot", "get_pattern_key", "_init_utils")}, table_rows(page), tmp_path)
    assert problems == [
        ("finetune/use.py:3 uses `_init_utils` but no row of docs/architecture.md's private-API table names `use.py` "
         "in its where cell and `_init_utils` in its private-use cell: add it to the row for that use, or add a row"),
        ("docs/architecture.md:8: stale: `gone.py` uses none of the row's names any more (['_old_name', "
         "'get_pattern_key']); finetune/gone.py is gone"),
        "docs/architecture.md:8: stale: `_old_name` is not used in ['gone.py', 'use.py']",
        "docs/architecture.md:8: no 'what breaks when the library changes'",
        "docs/architecture.md:8: pinned by `tests/test_x.py::test_none`, which does not exist"]
