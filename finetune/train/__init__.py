"""Layer `train`: one run, on a base the `weights` layer loads. preflight.py checks before any weights
load; lora.py adds adapters (and gradient checkpointing); optim.py builds the (sharded 8-bit) optimizer;
parallel.py the Accelerator, FSDP and the wrap; gather.py gathers the adapter to full shapes; loss.py the
loss (chunked head), lean.py memory-lean norms and MLPs, offload.py activation offloading; step.py one
optimizer step, scaling.py the fp16 loss scaler, guard.py the divergence guard, stop.py stop signals;
loop.py the one training loop; keepers/ what a run writes and guards in its run dir (checkpoints, the run
lock, metrics, trackers); inference.py scores and samples a finished run dir.
"""
