"""Activation offloading (recipe: model.activation_offloading, CUDA only): the tensors autograd keeps outside
checkpointed regions (with gradient checkpointing: each decoder layer's input) go to pinned CPU memory on a
side stream during the forward pass, and come back on another side stream one layer ahead of the backward
pass that needs them. The frozen input-embedding table then stays in CPU memory as well: its output is the
first of those layer inputs, so looking it up on the CPU saves the table's GPU copy and a round trip.

Built on torch.autograd.graph.saved_tensors_hooks, like torch's own `save_on_cpu`, which copies back only
when backward asks (no prefetch) and offloads every saved tensor, parameters' views included.
"""
from __future__ import annotations

import contextlib

import torch

MIN_BYTES = 2**20  # smaller saved tensors stay: a copy costs more latency than their memory is worth


class _Packed:
    """One offloaded tensor: its pinned CPU copy and, once prefetched, the GPU copy on its way back."""

    __slots__ = ("cpu", "device", "gpu", "__weakref__")

    def __init__(self, cpu, device):
        self.cpu, self.device, self.gpu = cpu, device, None


class ActivationOffload:
    """saved_tensors_hooks that offload to pinned memory and prefetch one tensor ahead in backward.

    On a CPU device (the test harness: tests/integration/test_offload_cpu.py) the same hooks, order and
    prefetch run, with plain synchronous copies into other host tensors: CUDA streams and pinned memory do
    not exist there, so the stream waits, `record_stream` and pinning are CUDA's alone."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES):
        self.device, self.min_bytes = device, min_bytes
        cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if cuda else None
        self.h2d = torch.cuda.Stream(device) if cuda else None
        self.order: list = []  # packed tensors of the current forward, in the order they were saved
        self.prefetched = 0  # tensors brought back ahead of the backward that needed them (all forwards)

    def _pack(self, t: torch.Tensor):
        if (t.device.type != self.device.type or isinstance(t, torch.nn.Parameter) or not t.is_floating_point()
                or t.numel() * t.element_size() < self.min_bytes):
            return t
        cpu = torch.empty_like(t, device="cpu", pin_memory=self.d2h is not None)
        if self.d2h is None:
            cpu.copy_(t)
        else:
            self.d2h.wait_stream(torch.cuda.current_stream(t.device))  # t is complete
            with torch.cuda.stream(self.d2h):
                cpu.copy_(t, non_blocking=True)
            t.record_stream(self.d2h)  # the allocator keeps t's memory until the copy is done
        p = _Packed(cpu, t.device)
        self.order.append(p)
        return p

    def _fetch(self, p: _Packed):
        if p.gpu is not None:
            return
        if self.h2d is None:
            p.gpu = p.cpu.clone()  # CPU: a copy of its own, as the GPU's is
            return
        self.h2d.wait_stream(self.d2h)  # its copy out has finished
        with torch.cuda.stream(self.h2d):
            p.gpu = p.cpu.to(p.device, non_blocking=True)

    def _unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        self._fetch(p)
        t, p.gpu = p.gpu, None
        if self.h2d is not None:
            main = torch.cuda.current_stream(p.device)
            main.wait_stream(self.h2d)
            t.record_stream(main)  # allocated on h2d, used on the main stream from here on
        i = next((k for k, q in enumerate(self.order) if q is p), None)
        if i:  # backward runs layers in reverse: bring the previous layer's input in now
            self._fetch(self.order[i - 1])
            self.prefetched += 1
        return t

    @contextlib.contextmanager
    def __call__(self):
        self.order = []
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


def embeddings_to_cpu(base, device: torch.device) -> bool:
    """Keep the frozen input embedding in (pinned) CPU memory: ids go to the CPU for the lookup and the
    rows come back to `device`. Only for an untied table that is a plain tensor (not an FSDP shard) and
    does not train. Returns whether it moved."""
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    w = getattr(emb, "weight", None)
    if w is None or w.requires_grad or type(w) is not torch.nn.Parameter or w.device.type != "cuda" \
            or (head is not None and getattr(head, "weight", None) is w):
        return False
    emb.weight = torch.nn.Parameter(w.detach().cpu().pin_memory(), requires_grad=False)
    emb.register_forward_pre_hook(lambda m, args: (args[0].to("cpu"), *args[1:]))
    emb.register_forward_hook(lambda m, args, out: out.pin_memory().to(device, non_blocking=True))
    return True


def _sharded(model) -> bool:
    """FSDP1 wraps the model in FullyShardedDataParallel; FSDP2 turns its parameters into DTensors."""
    from torch.distributed.tensor import DTensor

    return "FullyShardedDataParallel" in type(model).__name__ or any(
        isinstance(p, DTensor) for p in model.parameters())


def setup_offload(model, enabled: bool):
    """Once, at setup, on the wrapped model: the context every training forward runs under (an
    ActivationOffload, called for each forward) or None (off, or no CUDA). Under FSDP the embedding table
    is a shard that FSDP gathers on the GPU, so it stays where FSDP keeps it; otherwise it moves to
    pinned CPU memory (embeddings_to_cpu)."""
    if not enabled or not torch.cuda.is_available():
        return None
    from accelerate.utils import extract_model_from_parallel

    base = extract_model_from_parallel(model)
    device = next(p.device for p in base.parameters() if p.device.type == "cuda")
    if not _sharded(model):
        embeddings_to_cpu(base.get_base_model() if hasattr(base, "get_base_model") else base, device)
    return ActivationOffload(device)
