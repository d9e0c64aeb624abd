"""Private library internals are where an upgrade (or the GPU image's older torch) breaks us first
(docs/architecture.md, "Private library internals"). None of torch FSDP2's may be used anywhere, and a torch
function may be replaced (even for the length of a `with`) only in the modules listed here, each with the
reason and the test that pins it."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"
# FSDP2's internals: the shard fill goes through DTensor.from_local and load_state_dict(assign=True).
FSDP2_PRIVATE = ("_get_fsdp_state", "FSDPParam", "_local_tensor", "reset_sharded_param", "_fsdp_param_group",
                 "_module_info", "sharded_param")
# module -> why it still replaces torch functions (see docs/architecture.md for the pin tests).
PATCHES_TORCH = {"weights/fsdp1.py": "FSDP1 over meta parameters: _get_compute_device and flat_param_to"}


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


def test_torch_functions_are_replaced_only_where_listed():
    patching = {name for name, src in _sources() if torch_attribute_assignments(src)}
    assert patching == set(PATCHES_TORCH)


def test_the_patch_finder_finds_patches():
    src = "import torch\nfrom torch.distributed.fsdp import _init_utils as u\nu.f, x = 1, 2\ntorch.cuda.g = 3\ny.z = 4\n"
    assert torch_attribute_assignments(src) == ["u.f", "torch.cuda.g"]


def test_fsdp1_internals_the_meta_fill_uses_are_still_there():
    """weights/fsdp1.py's private uses of torch FSDP1, pinned: a torch that renames or reshapes any of them
    fails here, by name, before a sharded FSDP1 load fails somewhere in the middle."""
    import inspect

    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._flat_param import FlatParameter, FlatParamHandle

    assert list(inspect.signature(_init_utils._get_compute_device).parameters) == [
        "module", "ignored_params", "device_from_device_id", "rank", "device_handle"]
    assert callable(_init_utils._get_orig_params)
    for name in ("flat_param_to", "_use_sharded_views", "_get_shard_metadata"):
        assert callable(getattr(FlatParamHandle, name)), name
    assert list(inspect.signature(FlatParamHandle._get_shard_metadata).parameters)[1:] == [
        "unsharded_start_idx", "unsharded_end_idx"]
    # set on every FlatParameter by _init_metadata / _init_shard_metadata
    source = inspect.getsource(FlatParameter) + inspect.getsource(FlatParamHandle)
    for attr in ("_param_infos", "_shard_param_infos", "_params", "_shared_params", "_offload_params",
                 "uses_sharded_strategy"):
        assert attr in source, attr


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
