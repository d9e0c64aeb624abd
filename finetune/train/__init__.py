"""Layer `train`: one run. preflight.py checks before any weights load; model.py loads the tokenizer and
the quantized base; lora.py adds adapters; optim.py builds the (sharded 8-bit) optimizer; distributed.py the
Accelerator and FSDP; loss.py the loss (chunked head), lean.py memory-lean norms and MLPs, offload.py
activation offloading; loop.py the one training loop; checkpoint.py and metrics.py what a run
writes; evaluate.py scores a finished run dir.
"""
