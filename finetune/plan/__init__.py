"""Layer `plan`: what a run needs, from shapes alone; never imports torch.

archs.py reads a model's shapes (config.json, or architectures.json for common models); estimate.py plans
per-GPU memory and per-machine CPU RAM (with loading.py for the load phase, activations.py, logits.py for
the loss path and pinned.py for pinned host memory); disk.py the checkpoints' disk space; launcher.py the Accelerate
launcher config and its drift from a recipe; headers.py the plan block at the top of shipped recipes;
slurm.py a SLURM node's launch line; attention.py the attention-kernel rule the planner and the loop share.
"""
