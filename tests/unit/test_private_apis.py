"""Private library internals are where an upgrade (or the GPU image's older torch) breaks us first
(docs/architecture.md, "Private library internals"). None of torch FSDP2's may be used anywhere, and no module
replaces a torch function (not even for the length of a `with`): FSDP1's wrap of the streamed model goes
through its public `param_init_fn` (weights/fsdp1.py)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"
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
    """weights/fsdp1.py's private reads of torch FSDP1, pinned: a torch that renames or reshapes any of them
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
    """weights/expert_lora.py and weights/experts4bit.py lean on three things of peft's ParamWrapper that
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
