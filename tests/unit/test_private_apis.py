"""Private library internals are where an upgrade (or the GPU image's older torch) breaks us first
(docs/architecture.md, "Private library internals"). Every private use in finetune/ has its row in that page's
table (test_private_api_table.py keeps it true both ways). None of torch FSDP2's internals may be used anywhere, and no module
replaces a torch function (not even for the length of a `with`): FSDP1's wrap of the streamed model goes
through its public `param_init_fn`. The pins below check, one by one, the library behaviour
each row relies on, so an upgrade fails here by name (fast, CPU only)."""
import ast
import inspect
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
    try:  # the suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py): off first, so the switch is seen to work
        datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = False
        assert not hub_constants.is_offline_mode()
        file_utils._raise_if_offline_mode_is_enabled()
        datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
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


def test_dynamo_counts_graphs_and_a_marked_dimension_reuses_one():
    """train/compiled.py counts recompiles as dynamo's `counters["stats"]["unique_graphs"]` and marks the
    sequence dimension dynamic (`torch._dynamo.mark_dynamic`): a second length then reuses the graph, and
    each graph made counts one."""
    import torch
    from torch._dynamo.utils import counters

    def f(x):
        return (x * 2).sum(-1)

    torch.compiler.reset()
    fn, start = torch.compile(f, backend="eager", fullgraph=True), counters["stats"]["unique_graphs"]
    for n in (5, 7):
        x = torch.ones(2, n)
        torch._dynamo.mark_dynamic(x, 1)
        assert fn(x).tolist() == [2.0 * n] * 2
    assert counters["stats"]["unique_graphs"] - start == 1
    fixed = torch.compile(lambda x: (x + 1).sum(-1), backend="eager", fullgraph=True, dynamic=False)
    fixed(torch.ones(2, 5)), fixed(torch.ones(2, 7))
    assert counters["stats"]["unique_graphs"] - start == 3  # one graph per length without the mark
    torch.compiler.reset()
