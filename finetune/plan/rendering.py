"""The memory plan as `finetune estimate` prints it: the setup in two lines, then the bytes per device by
term (finetune.plan.estimate.build), what torch's allocator and CUDA add, and the CPU RAM by phase."""
from __future__ import annotations

from finetune.plan.activations import checkpointing_words
from finetune.plan.estimate import Plan, lora_tensor_sizes
from finetune.util.units import fmt


def render(p: Plan) -> str:
    s = p.setup
    lines = [f"plan for {s.model} ({p.source}): {p.arch.params() / 1e9:.2f}B params, "
             f"{sum(lora_tensor_sizes(p.arch, s)) / 1e6:.1f}M trainable",
             f"  {s.world} process(es) on {s.machines} machine(s), strategy {s.strategy}"
             + (f" (FSDP{s.fsdp_version}{', cpu offload' if s.offload else ''})" if s.strategy == "fsdp" else "")
             + f", micro-batch {s.micro_batch} x seq {s.seq_len}, checkpointing {checkpointing_words(p.arch, s)}",
             f"GPU memory per device: {fmt(p.gpu_bytes_per_device)}" if s.device == "cuda" else
             f"memory per process (a CPU run: in RAM, counted in the CPU RAM below): {fmt(p.gpu_bytes_per_device)}"]
    # terms of features a run may not use at all are shown only when it does
    shown = {k: v for k, v in p.breakdown.items()
             if k != "framework_overhead" and (v or k not in ("dora_workspace", "router_balance"))}
    lines += [f"  {k:<20} {fmt(v):>12}" for k, v in shown.items()]
    if s.device == "cuda":
        o = p.overhead
        lines += [f"  = peak allocated     {fmt(p.allocated):>12}  (torch.cuda.max_memory_allocated)",
                  f"  + allocator slack    {fmt(o['allocator_slack']):>12}  (reserved {fmt(p.reserved)})",
                  f"  + CUDA context{' + NCCL' if o['nccl'] else '':<7}{fmt(o['cuda_context'] + o['nccl']):>12}"
                  f"  (not torch's; total {fmt(p.gpu_bytes_per_device)})"]
    if p.load_gpu:
        lines.append(f"GPU memory per device while loading: {fmt(p.load_gpu)}")
    phase = max(p.cpu, key=p.cpu.get)
    lines.append(f"CPU RAM per machine: {fmt(p.cpu_bytes_peak)} peak ({phase})")
    lines += [f"  {k:<20} {fmt(v):>12}" for k, v in p.cpu.items()]
    fit = p.fits()
    if fit is not None:
        spare = s.gpu_memory - p.gpu_bytes_per_device
        lines.append(f"fits in {fmt(s.gpu_memory)}: {'yes' if fit else 'NO'} "
                     f"({'spare' if fit else 'short by'} {fmt(abs(spare))})")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
