"""The training loop's loss (train.loss.token_loss_sum) against the textbook computation on the 4-bit + LoRA tiny
model: the output head runs on trained positions only, yet the loss and every adapter gradient are those of
full logits; and the attention kernel choice of finetune.plan.attention is the one that actually runs."""
import pytest
import torch
import torch.nn.functional as F

from finetune.data import batching as B
from finetune.data import encode as E
from finetune.recipe import DataSpec, LoraSpec, ModelSpec, QuantizationSpec, TrainSpec

from .conftest import tiny_lora_fp32


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": f"reverse: {' '.join(['red', 'cat', 'sun', 'dog', 'fox'][: 1 + i % 5])}\n",
             "completion": " ".join(["dog", "fox", "owl"][: 1 + i % 3])} for i in range(6)]
    batch = B.collate([E.encode(r, "auto", tok, DataSpec()) for r in rows], tok.pad_token_id)
    # fp32 dequantization: with mixed_precision "no" nothing then rounds to bf16, so two correct
    # computations of the same loss agree to fp32 rounding (bf16 matmuls would turn 1e-7 into 1e-3)
    model = tiny_lora_fp32(tiny_model_dir)  # non-zero adapters: every LoRA tensor gets a gradient
    return model, batch


def lora_grads(model) -> dict:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("chunk", [0, 5])  # automatic (one chunk for this vocabulary), and 5 rows per chunk
def test_chunked_head_on_trained_rows_gives_the_full_logits_loss_and_gradients(setup, chunk):
    from finetune.train.loss import token_loss_sum

    model, batch = setup
    labels = batch["labels"]
    trained = int((labels[:, 1:] != E.IGNORE).sum())
    assert 0 < trained < labels[:, 1:].numel() / 2  # prompts and padding dominate: the case this is for
    assert chunk == 0 or trained > 3 * chunk  # several chunks, the last one partial

    spec = TrainSpec(mixed_precision="no", loss_chunk_tokens=chunk)  # fp32: both must agree to rounding
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                          ignore_index=E.IGNORE, reduction="sum")
    ref.backward()
    ref_grads = lora_grads(model)
    # The same loss with an fp64 softmax: how far fp32 rounding at the head alone moves the adapter
    # gradients through the layers (~1e-4 relative on this model; the loss itself agrees to 1e-7).
    logits = model(**inputs, use_cache=False).logits.double()
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                    ignore_index=E.IGNORE, reduction="sum").backward()
    exact = lora_grads(model)

    head = model.get_output_embeddings()
    outputs = []
    probe = head.register_forward_hook(lambda m, a, out: outputs.append(out))
    try:
        loss, n = token_loss_sum(model, batch, "cpu", spec)
    finally:
        probe.remove()
    loss.backward()
    grads = lora_grads(model)

    assert [o.shape for o in outputs] == [torch.Size([])]  # the head returned the loss, never logits
    assert "forward" not in vars(head)  # and it is an ordinary head again once the forward is done
    assert n == trained
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4 * 7 * 2
    def rel(a, b):  # per tensor: single elements can cancel to ~0
        return float((a - b).norm() / b.norm())

    # every adapter gradient as close to the fp64-softmax one as the full-logits loss's, to fp32 rounding (the
    # chunked head itself matches to 1e-6: test_chunked_head_loss_matches_cross_entropy...). Within 2x, not
    # "at least as close": where torch's fp32 matmul picks its kernel by shape (oneDNN on an AMX Xeon) the
    # two paths round differently, measured 3.8e-5 against 2.7e-5 there, and equal on an AVX2 EPYC.
    assert max(rel(g, exact[k]) for k, g in grads.items()) <= 2 * max(rel(g, exact[k]) for k, g in ref_grads.items())
    assert max(rel(g, ref_grads[k]) for k, g in grads.items()) <= 2e-4


def test_chunked_head_loss_matches_cross_entropy_with_bias_and_trained_head():
    # A head that trains (and has a bias) gets the full-logits gradients too, chunk by chunk.
    from finetune.train.loss import chunked_head_loss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(101, 16, generator=g, requires_grad=True)
    b = torch.randn(101, generator=g, requires_grad=True)
    t = torch.randint(0, 101, (37,), generator=g)
    ref = F.cross_entropy(x @ w.t() + b, t, reduction="sum")
    ref_grads = torch.autograd.grad(3 * ref, (x, w, b))
    loss = chunked_head_loss(x, w, b, t, rows=5)
    grads = torch.autograd.grad(3 * loss, (x, w, b))
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    for got, want in zip(grads, ref_grads):
        assert float((got - want).norm() / want.norm()) <= 1e-5


def test_models_that_rescale_logits_take_the_full_logits_path(setup):
    # Gemma 2 soft-caps the head's output: the head's result is not the logits there.
    from finetune.train.loss import chunkable

    model, _ = setup
    base = model.get_base_model()
    assert chunkable(base)
    base.config.final_logit_softcapping = 30.0
    try:
        assert not chunkable(base)
    finally:
        base.config.final_logit_softcapping = None


def saved_shapes(kernels, seq: int) -> list[tuple]:
    """Shapes of the fp32 tensors SDPA saves for backward for one causal GQA call under `kernels`."""
    q = torch.randn(2, 4, seq, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, seq, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    seen = []

    def pack(t):
        if t.dtype == torch.float32:
            seen.append(tuple(t.shape))
        return t

    with kernels, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return seen


@pytest.mark.parametrize("device,precision,seq,math", [
    ("cpu", "bf16", 64, True), ("cpu", "bf16", 128, True),  # short bf16 batches on CPU: the math kernel
    ("cpu", "bf16", 256, False), ("cpu", "no", 64, False), ("cuda", "bf16", 64, False)])
def test_attention_kernels_pick_the_math_kernel_only_for_short_bf16_cpu_batches(device, precision, seq, math):
    from finetune.train.loss import attention_kernels

    shapes = saved_shapes(attention_kernels(device, precision, seq), seq)
    # the math kernel keeps the [batch * heads, T, T] fp32 probabilities; the flash kernel keeps only a
    # per-row logsumexp
    assert ((2 * 4, seq, seq) in shapes) is math, shapes


def test_lean_norms_and_mlps_give_the_stock_loss_and_gradients(tiny_model_dir):
    # finetune.train.lean keeps less for backward and recomputes the rest with the modules' own forward:
    # the same loss, the same adapter gradients up to summation order, and fewer bytes saved for backward.
    from benchmarks.cpu.memcheck import SavedTensorMeter
    from finetune.train import lean
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model

    model = load_model(ModelSpec(name=str(tiny_model_dir), gradient_checkpointing=False),
                       QuantizationSpec(compute_dtype="float32"), quiet=True)
    model = apply_lora(model, LoraSpec(r=8, dropout=0.0), seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def run():
        meter = SavedTensorMeter(model)
        with meter():  # fp32: bf16 matmuls would turn summation-order differences (1e-7) into 1e-3
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return float(loss), lora_grads(model), meter.total

    loss, grads, saved = run()
    assert lean.apply(model) == 4 * 3 + 1  # two norms and one MLP in each of 4 layers, and the final norm
    lean_loss, lean_grads, lean_saved = run()
    assert lean_loss == loss  # the forward is the stock one
    # backward differs from the stock graph only in the order gradients are summed into the residual
    # stream (each module's own backward is bit for bit the stock one: its forward runs again under autograd)
    worst = max(float((g - grads[k]).norm() / grads[k].norm()) for k, g in lean_grads.items())
    # (on this model fp32 rounding anywhere moves adapter gradients ~1e-4: see the chunked-loss test above)
    assert worst <= 2e-4 and len(grads) == 4 * 7 * 2, worst
    assert lean_saved < saved


def test_tiled_mlp_on_the_4bit_tiny_model_gives_the_untiled_loss_and_lora_gradients(setup):
    # model.tiled_mlp (finetune.train.tiled): the MLPs over the tokens in chunks, recomputed per chunk in
    # backward; fp32 dequantization, no autocast: both computations agree to fp32 rounding
    from tests.integration.test_tiled_mlp import assert_same, loss_and_grads

    from finetune.train import tiled

    model, batch = setup
    ids = batch["input_ids"]
    untiled = loss_and_grads(model, ids)
    # chunks of 32 tokens, the last one short. (Chunks of a row count that is not a multiple of 16 change
    # the CPU matmul's blocking and so its rounding, which this model amplifies to ~1e-4 in its adapter
    # gradients, measured; hidden_size, the default chunk, is a multiple of 16 in real models.)
    assert ids.numel() % 32 and ids.numel() > 64
    try:
        assert tiled.apply(model, 32, hidden=model.config.hidden_size) == 4
        assert_same(untiled, loss_and_grads(model, ids), n_grads=4 * 7 * 2)
        assert tiled.apply(model, 32, hidden=0) == 4  # already tiled: left as it is, not tiled twice
    finally:  # the module's other tests use this model untiled
        for m in model.modules():
            if vars(m).pop("_finetune_tiled", False):
                del m.forward


def test_the_loss_changes_no_module_setup_puts_the_lean_modules_in(tiny_model_dir):
    """The loss only computes; what changes modules (the memory-lean norms and MLPs) happens once, at setup,
    where _train shows it (loss.setup_forward)."""
    from finetune.train.loss import setup_forward, token_loss_sum
    from finetune.train.lora import apply_lora
    from finetune.weights.load.model import load_model

    model = load_model(ModelSpec(name=str(tiny_model_dir), gradient_checkpointing=False),
                       QuantizationSpec(compute_dtype="float32"), quiet=True)
    model = apply_lora(model, LoraSpec(r=8, dropout=0.0), seed=0)
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    swapped = lambda: sum("forward" in vars(m) for m in model.modules())  # noqa: E731
    token_loss_sum(model, {"input_ids": ids, "labels": ids}, "cpu", TrainSpec(mixed_precision="no"))
    assert swapped() == 0
    assert setup_forward(model, activation_offloading=False) is None  # no offloading asked (and no CUDA)
    assert swapped() == 4 * 3 + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amp", [False, True])
def test_each_lean_module_is_the_stock_one_bit_for_bit(amp, dtype):
    # bf16 inputs are the GPU recipes' residual stream: the lean norm recomputes there (fp32 runs it as is)
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

    from finetune.train import lean

    torch.manual_seed(0)
    for module in (LlamaRMSNorm(64), LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128))):
        module.to(dtype).requires_grad_(False)
        x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
        outs, grads = [], []
        for step in ("stock", "lean"):
            if step == "lean":
                assert lean.apply(module) == 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                y = module(x)
            y.backward(torch.ones_like(y) * torch.linspace(-1, 1, y.size(-1), dtype=y.dtype))
            outs.append(y.detach())
            grads.append(x.grad)
            x.grad = None
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), type(module).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_norm_keeps_only_its_input(dtype):
    """Beyond its input, the stock RMSNorm saves an fp32 upcast of it for backward (bf16 input) or, when
    the input is fp32 and so its own upcast, only a rsqrt per row; the lean norm saves nothing beyond its
    input, by recomputing in the first case and by running the stock norm in the second."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from finetune.train import lean

    norm = LlamaRMSNorm(64).to(dtype).requires_grad_(False)
    x = torch.randn(32, 64, dtype=dtype, requires_grad=True)

    def saved_beyond_input() -> int:
        extra = {}

        def pack(t):
            if t.data_ptr() not in (x.data_ptr(), norm.weight.data_ptr()):
                extra[t.data_ptr()] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = norm(x)  # what is kept from the forward to the backward (not the recomputation's own)
        y.sum().backward()
        return sum(extra.values())

    stock = saved_beyond_input()
    assert lean.apply(norm) == 1
    leaned = saved_beyond_input()
    if dtype == torch.float32:
        assert stock == leaned == 32 * 4  # the rsqrt only: nothing for a recomputation to save
    else:
        assert stock >= 32 * 64 * 4 and leaned == 0


def test_lean_modules_run_under_module_trackers():
    """FlopCounterMode (like torch's memory trackers) hooks every module call; the lean MLP's recomputation
    in backward must not call the activation module, whose hooks torch refuses inside a nested grad."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

    from finetune.train import lean

    torch.manual_seed(0)
    for module in (LlamaRMSNorm(64), LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128))):
        module.requires_grad_(False)
        assert lean.apply(module) == 1
        x = torch.randn(8, 64, requires_grad=True)
        counter = FlopCounterMode(display=False)
        with counter:
            module(x).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    assert counter.get_total_flops() > 0  # the MLP's matmuls were seen


def test_a_micro_batch_reads_nothing_back_from_the_device_in_finetune_code(setup):
    """The ops that make a GPU host wait (a scalar read, nonzero, a boolean-mask select) recorded through
    torch's dispatch during a micro-batch's forward and backward, as the loop runs them (device_batch
    first): none comes from finetune's own lines. On an H200 this was 6 waits per micro-batch before
    (benchmarks/RESULTS_GPU.md, syncs); what remains is transformers' mask builder, once per forward."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from finetune.train.loss import device_batch, token_loss_sum

    model, batch = setup
    waits = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default}
    seen = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            indexing = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
                                torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default)
            boolean_index = indexing and any(t is not None and t.dtype == torch.bool for t in args[1])
            if func in waits or boolean_index:
                ours = [f"{fr.filename.split('finetune/')[-1]}:{fr.lineno}" for fr in traceback.extract_stack()
                        if "/finetune/" in fr.filename and "/tests/" not in fr.filename]
                seen.append((str(func), ours[-1] if ours else None))
            return func(*args, **(kwargs or {}))

    b = device_batch(batch, torch.device("cpu"))  # on the host, before the step: allowed to read
    with Reads():
        loss, n = token_loss_sum(model, b, "cpu", TrainSpec(mixed_precision="no"))
        loss.backward()
    model.zero_grad(set_to_none=True)
    assert n == int((batch["labels"][:, 1:] != E.IGNORE).sum())
    # Every read happens inside the model's forward call (loss.py's `model(**inputs)` line is the innermost
    # finetune frame: the read is transformers' mask check, here on padded rows), none on a line of the loss.
    import finetune.train.loss as L

    lines = open(L.__file__).read().splitlines()
    calls = {f"train/loss.py:{i + 1}" for i, ln in enumerate(lines) if "= model(**inputs, use_cache=False)" in ln}
    assert seen and {at for _, at in seen} <= calls, seen
