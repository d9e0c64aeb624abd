"""Layer `merge`: fold a trained LoRA adapter into its base, one safetensors shard at a time.

source.py finds the inputs (run dir or PEFT adapter, the base, its tensor headers); plan.py holds the pure
per-tensor pieces (adapter keys, scaling, shard plan, the NF4 round trip); stream.py writes the merged shards
into a temporary directory; check.py compares its logits with base + adapter before it is renamed into place;
card.py writes the model card. Nothing here imports `train/` (the architecture test checks it); what
the merge shares with training (devices, adapter files, synthetic bases) lives in `weights/`.
"""
