"""Private library internals are where an upgrade (or the GPU image's older torch) breaks us first
(docs/architecture.md, "Private library internals"). Every private use in finetune/ has its row in that page's
table (what breaks, which test pins it), and every row names a use that still exists: `test_every_private_use_
has_its_row` and the rule above `LIBRARIES`. None of torch FSDP2's internals may be used anywhere, and no module
replaces a torch function (not even for the length of a `with`): FSDP1's wrap of the streamed model goes
through its public `param_init_fn`. The tests after the table's check pin, one by one, the library behaviour
each row relies on, so an upgrade fails here by name (fast, CPU only)."""
import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "finetune"
PAGE = ROOT / "docs" / "architecture.md"
# FSDP2's internals: the shard fill goes through DTensor.from_local and load_state_dict(assign=True).
FSDP2_PRIVATE = ("_get_fsdp_state", "FSDPParam", "_local_tensor", "reset_sharded_param", "_fsdp_param_group",
                 "_module_info", "sharded_param")


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(PACKAGE)), path.read_text()


def test_no_fsdp2_private_attribute_is_used():
    found = [f"{name}: {word}" for name, src in _sources() for word in FSDP2_PRIVATE if word in src]
    assert found == []


def torch_attribute_assignments(src: str) -> list[str]:
    """`x.attr = ...` (or in a tuple target) where x is a name this source imported from torch."""
    tree = ast.parse(src)
    from_torch = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            from_torch |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            from_torch |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    base = t
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    if isinstance(t, ast.Attribute) and isinstance(base, ast.Name) and base.id in from_torch:
                        out.append(ast.unparse(t))
    return out


def test_no_torch_function_is_replaced():
    patching = {name: torch_attribute_assignments(src) for name, src in _sources()}
    assert {name: found for name, found in patching.items() if found} == {}


def test_the_patch_finder_finds_patches():
    src = "import torch\nfrom torch.distributed.fsdp import _init_utils as u\nu.f, x = 1, 2\ntorch.cuda.g = 3\ny.z = 4\n"
    assert torch_attribute_assignments(src) == ["u.f", "torch.cuda.g"]


def test_fsdp1_internals_the_shard_fill_uses_are_still_there():
    """weights/shard/fsdp1.py's private reads of torch FSDP1, pinned: a torch that renames or reshapes any of them
    fails here, by name, before a sharded FSDP1 load fails somewhere in the middle. The wrap itself is
    FSDP1's public path (`param_init_fn`), which calls the function per unit before it flattens."""
    import inspect

    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._flat_param import FlatParameter, FlatParamHandle

    assert callable(FlatParamHandle._get_shard_metadata)
    assert list(inspect.signature(FlatParamHandle._get_shard_metadata).parameters)[1:] == [
        "unsharded_start_idx", "unsharded_end_idx"]
    # set on every FlatParameter by _init_metadata / _init_shard_metadata
    source = inspect.getsource(FlatParameter) + inspect.getsource(FlatParamHandle)
    for attr in ("_param_infos", "_shard_param_infos", "_params", "_shared_params", "uses_sharded_strategy",
                 "offset_in_shard", "numel_in_shard", "intra_param_start_idx"):
        assert attr in source, attr
    # param_init_fn runs on the unit's modules before the flat parameter is built from them
    wrap = inspect.getsource(_init_utils._init_param_handle_from_module)
    assert wrap.index("_materialize_with_param_init_fn") < wrap.index("_init_param_handle_from_params")


def test_peft_param_wrapper_behaviour_packed_experts_rely_on():
    """weights/experts/expert_lora.py and weights/experts/module.py lean on three things of peft's ParamWrapper that
    its docs do not promise: it sizes a parameter's adapters from `ds_shape` when the parameter has one
    (the packed 4-bit experts' logical [E, out, in]); `get_delta_factors` gives per-expert (lhs, rhs,
    scaling) with delta_e = scaling * lhs_e @ rhs_e equal to get_delta_weight's; and it nests a second
    wrapped parameter of one module only inside a class named exactly ParamWrapper (hence `adopt`
    swaps the class after injection rather than dispatching a subclass)."""
    import inspect

    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTuner

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(6, 1), requires_grad=False)  # "packed"
            self.gate_up_proj.ds_shape = torch.Size((3, 10, 4))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    model = get_peft_model(Model(), LoraConfig(r=2, target_modules=[], target_parameters=["experts.gate_up_proj"],
                                               init_lora_weights=False))
    wrapper = model.base_model.model.experts
    assert type(wrapper) is ParamWrapper and wrapper.num_experts == 3
    assert wrapper.lora_A["default"].weight.shape == (2 * 3, 4) and wrapper.lora_B["default"].weight.shape == (10, 2 * 3)
    lhs, rhs, scaling = wrapper.get_delta_factors("default")
    assert lhs.shape == (3, 10, 2) and rhs.shape == (3, 2, 4)
    torch.testing.assert_close(scaling * lhs @ rhs, wrapper.get_delta_weight("default"))
    assert '.__class__.__name__ != "ParamWrapper"' in inspect.getsource(BaseTuner._inject_parameters)


# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# Pins: each library behaviour a row of the table relies on, checked where no other test reaches it on a CPU.


def test_swap_tensors_keeps_a_forged_class_and_dict():
    """FSDP1's param_init gives a meta Params4bit memory in place: a plain Parameter on the new memory borrows
    the old one's class and `__dict__` for torch.utils.swap_tensors, so the same object (the optimizer holds
    it) keeps its class and quantization arguments, now on the new memory."""
    import bitsandbytes as bnb
    import torch

    t = bnb.nn.Params4bit(torch.empty(6, 1, dtype=torch.uint8, device="meta"), requires_grad=False,
                          quant_type="nf4", blocksize=64, bnb_quantized=True)
    before = id(t)
    data = torch.arange(6, dtype=torch.uint8).reshape(6, 1)
    new = torch.nn.Parameter(data, requires_grad=False)
    new.__class__, new.__dict__ = t.__class__, t.__dict__
    torch.utils.swap_tensors(t, new)
    new.__dict__ = {}
    assert id(t) == before and type(t) is bnb.nn.Params4bit and t.device.type == "cpu"
    assert (t.quant_type, t.blocksize, t.bnb_quantized) == ("nf4", 64, True) and torch.equal(t.data, data)



def test_params4bit_marked_quantized_is_not_quantized_again():
    """The streamed load hands bitsandbytes bytes it packed already: `Params4bit(packed, quant_state=...,
    module=linear, bnb_quantized=True)` keeps them as they are when moved; unmarked, `.to` would quantize the
    packed bytes again as if they were weights."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf
    import torch

    w = torch.randn(8, 64)
    packed, qs = bf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    lin = bnb.nn.Linear4bit(64, 8, quant_type="nf4")
    kw = {"requires_grad": False, "quant_state": qs, "blocksize": 64, "quant_type": "nf4",
          "compress_statistics": False, "quant_storage": torch.uint8}
    p = bnb.nn.Params4bit(packed, module=lin, bnb_quantized=True, **kw)
    assert p.module is lin and p.bnb_quantized
    moved = p.to("cpu")
    assert torch.equal(moved.data, packed) and moved.quant_state is qs
    torch.testing.assert_close(bf.dequantize_4bit(moved.data, moved.quant_state), bf.dequantize_4bit(packed, qs))
    unmarked = bnb.nn.Params4bit(w.clone(), requires_grad=False, blocksize=64, quant_type="nf4").to("cpu")
    assert unmarked.bnb_quantized and unmarked.shape != w.shape  # unmarked, `.to` quantizes what it holds


def test_linear4bit_cpu_repacking_switch_is_there():
    """disable_cpu_weight_repacking (and the merge check's forward) turn off Linear4bit's CPU repacking through
    its `support_avx512bf16_for_cpu` attribute, which its forward consults."""
    import bitsandbytes as bnb

    assert hasattr(bnb.nn.Linear4bit(4, 4), "support_avx512bf16_for_cpu")
    assert "support_avx512bf16_for_cpu" in inspect.getsource(bnb.nn.Linear4bit.forward)


def test_bitsandbytes_quantize_4bit_op_keeps_its_schema():
    """weights' quantize_piece calls bitsandbytes' registered op by its schema's argument names."""
    import bitsandbytes  # noqa: F401  (registers the op)
    import torch

    schema = torch.ops.bitsandbytes.quantize_4bit.default._schema
    assert [a.name for a in schema.arguments] == ["A", "blocksize", "quant_type", "quant_storage"]
    assert len(schema.returns) == 2


def test_mkldnn_bf16_probe_answers():
    """cpu_bf16_is_native asks oneDNN through its op; gone, every CPU would count as bf16-slow (fp32 compute)."""
    import torch

    assert isinstance(torch.ops.mkldnn._is_mkldnn_bf16_supported(), bool)


def test_allocator_history_calls_take_what_the_memory_keeper_passes():
    """The GPU memory trace (FINETUNE_MEMORY_TRACE) starts, snapshots and stops the allocator's history with
    these private calls and keywords, and reads the snapshot's `device_traces`. No public form exists."""
    import torch

    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries", "device"} <= set(record)
    assert "device" in inspect.signature(torch.cuda.memory._snapshot).parameters
    assert "device_traces" in inspect.getsource(torch.cuda.memory)


def test_an_instance_forward_replaces_the_class_forward_until_deleted():
    """lean.py and loss.py swap `forward` on module instances: the module's call (with its hooks, so FSDP's)
    runs the instance's forward, other modules of the class keep theirs, and `del` restores the class's."""
    import torch

    lin, other, x = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.randn(3, 2)
    calls = []
    lin.register_forward_pre_hook(lambda m, args: calls.append("hook"))
    lin.forward = lambda h: calls.append("forward") or h
    assert lin(x) is x and calls == ["hook", "forward"] and "forward" in vars(lin)
    torch.testing.assert_close(other(x), torch.nn.functional.linear(x, other.weight, other.bias))
    del lin.forward
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


@pytest.fixture(scope="module")
def meta_llama():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def test_model_attributes_the_loop_and_the_wrap_read(meta_llama):
    """The loop picks the packing layout from `config._attn_implementation`; the FSDP wrap takes its layer
    classes from `_no_split_modules` when the recipe names none."""
    assert meta_llama.config._attn_implementation in ("sdpa", "eager")
    assert list(meta_llama._no_split_modules) == ["LlamaDecoderLayer"]


def test_hf_quantizer_hooks_swap_linears_on_a_meta_model():
    """The skeleton does what from_pretrained does for a 4-bit load, on the meta model: the quantizer's
    `preprocess_model` (with these keywords) swaps nn.Linear for Linear4bit except the head, and the model
    carries it as `hf_quantizer` (transformers and peft read `is_quantized` from it)."""
    import bitsandbytes as bnb
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig
    from transformers.quantizers import AutoHfQuantizer

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    quantizer = AutoHfQuantizer.from_config(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
                                            pre_quantized=False)
    quantizer.preprocess_model(model=model, dtype=torch.bfloat16, device_map=None, checkpoint_files=None,
                               use_kernels=False)
    model.hf_quantizer = quantizer
    assert type(model.model.layers[0].self_attn.q_proj) is bnb.nn.Linear4bit and type(model.lm_head) is torch.nn.Linear
    assert model.is_quantized
    assert next(iter(inspect.signature(quantizer.postprocess_model).parameters)) == "model"


def test_transformers_4bit_skip_rules_the_merge_reads(meta_llama):
    """merge/'s four_bit_weights finds the linears transformers' 4-bit loader converts with its own rules."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = list(set(get_keys_to_not_convert(meta_llama)) | set(getattr(meta_llama, "_keep_in_fp32_modules", None)
                                                               or []))
    assert skip == ["lm_head"]
    assert should_convert_module("model.layers.0.self_attn.q_proj", skip)
    assert not should_convert_module("lm_head", skip)


def test_config_mapping_names_lists_the_native_model_types():
    """Preflight tells a checkpoint with its own code apart from a model type transformers implements."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert CONFIG_MAPPING_NAMES["llama"] == "LlamaConfig" and "not-a-model-type" not in CONFIG_MAPPING_NAMES


def test_get_pattern_key_resolves_as_the_merge_expects():
    """The merge resolves rank_pattern / alpha_pattern with peft's own matcher: a matching key of the pattern,
    else the module name itself (so `pattern.get(..., default)` falls back to the adapter's value)."""
    from peft.utils.other import get_pattern_key

    assert get_pattern_key(["q_proj", "v_proj"], "model.layers.1.self_attn.q_proj") == "q_proj"
    module = "model.layers.0.mlp.down_proj"
    assert {"q_proj": 8}.get(get_pattern_key(["q_proj"], module), 16) == 16


def test_pydantic_private_attribute_written_from_outside_is_kept():
    """recipe/read.py and train/parallel.py mark a resolved `strategy: auto` by writing the distributed
    section's private `_from_auto` from outside it; pydantic keeps it, also on a copy."""
    from pydantic import BaseModel, PrivateAttr

    class Section(BaseModel):
        strategy: str = "auto"
        _from_auto: bool = PrivateAttr(default=False)

    s = Section()
    s._from_auto = True
    assert s._from_auto and s.model_copy()._from_auto and "_from_auto" not in s.model_dump()


def test_offline_switches_are_module_globals_read_at_call_time():
    """data/sources.py makes a hub read offline by setting datasets' and huggingface_hub's HF_HUB_OFFLINE
    module globals for the read: both libraries must read them when called, not copy them at import."""
    import datasets.config
    import huggingface_hub.constants as hub_constants
    from datasets.utils import file_utils

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        assert hub_constants.is_offline_mode()
        with pytest.raises(ConnectionError):
            file_utils._raise_if_offline_mode_is_enabled()
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved



def test_llama_cpp_converter_hook_is_there():
    """The shim wraps the converter's `TextModel.get_vocab_base_pre` and reads its probe text (`chktxt`) from
    that method's source: both must be in the pinned converter (read as text, not imported)."""
    from finetune.gguf import converter

    base = converter.converter_dir() / "conversion" / "base.py"
    if not base.exists():
        pytest.skip(f"no llama.cpp converter at {base.parent} ({converter.FETCH_COMMAND})")
    tree = ast.parse(base.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "TextModel")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_vocab_base_pre")
    assert [a.arg for a in method.args.args] == ["self", "tokenizer"]
    assert any(isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "chktxt" for n in ast.walk(method))
