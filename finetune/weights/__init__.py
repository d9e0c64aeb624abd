"""Layer `weights`: the frozen base model in memory, without training it. The streaming 4-bit loader reads
the base model tensor by tensor, so no process holds more than its share.

The model is built on the meta device from config.json (transformers' own bitsandbytes quantizer swaps
the target linears for `Linear4bit`, exactly as `from_pretrained` does). Then the checkpoint's safetensors
are read one tensor at a time by one reader per machine (its local rank 0); each linear weight is quantized
on the reader's device, in blocks of rows (or, for a pre-quantized `*-bnb-4bit` checkpoint, its packed bytes
and quantization state are read as stored). One process, or replicas, receive every tensor whole (a
broadcast); under FSDP each rank is sent only its part of every tensor, packed 4-bit bytes included, as it
is read or quantized (load/packed.py).

Where each part lives, by concern (one folder each; docs/architecture.md has the map): load/ (the one pass
down from `load/model.load_with_plan`: names, skeleton, plan, placement, reader, quantization, each rank's
packed bytes), experts/ (fused MoE experts held 4-bit), shard/ (FSDP: the one call before the wrap and the
fill after, one module per FSDP version), built/ (synthetic and pre-quantized bases); bnb.py (bitsandbytes'
configuration, also the merge's) and heap.py (memory back to the OS) below them. The placements:

- `whole` (one process, or replicas): every tensor is set at once; the bf16 weights are never all held,
  only one tensor at a time.
- `fsdp2`: nothing is set at load time (a placeholder stands in, so LoRA can be attached); `wrap`
  shards the meta model with `fully_shard` and then `shard/fsdp2.fill_shards` streams the checkpoint again,
  each rank keeping only its dim-0 chunk of every parameter: the packed 4-bit bytes included.
- `fsdp1`: FSDP1 flattens and shards the model unit by unit (its `param_init_fn` gives a unit's meta
  parameters memory just before), then `shard/fsdp1.fill_shards` fills each rank's slice of every flat
  parameter, reading only the rows that slice covers (shard/fsdp1.py).

Quantization state (absmax, nested absmax, code, ...) is kept whole on every rank, on the `Linear4bit`
module (`module.quant_state`), where bitsandbytes finds it again after FSDP gathers the packed weight.
"""