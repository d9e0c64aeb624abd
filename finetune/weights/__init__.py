"""Layer `weights`: the frozen base model in memory, without training it. The streaming 4-bit loader reads
the base model tensor by tensor, so no process holds more than its share.

The model is built on the meta device from config.json (transformers' own bitsandbytes quantizer swaps
the target linears for `Linear4bit`, exactly as `from_pretrained` does). Then the checkpoint's safetensors
are read one tensor at a time by one reader per machine (its local rank 0); each linear weight is quantized
on the reader's device, in blocks of rows (or, for a pre-quantized `*-bnb-4bit` checkpoint, its packed bytes
and quantization state are read as stored). One process, or replicas, receive every tensor whole (a
broadcast); under FSDP each rank is sent only its part of every tensor, packed 4-bit bytes included, as it
is read or quantized (packed.py).

Where each part lives: resolve.py (names, tokenizer, attention), model.py (the entry point, load_model),
skeleton.py (the meta model and its first pass), reader.py and tensorfile.py (the safetensors reads),
quantize.py (4-bit quantization piece by piece), packed.py (each rank's packed bytes), fsdp2.py and fsdp1.py
(the shard fills after wrapping), heap.py (memory back to the OS), placement.py (what each process keeps),
device.py (devices and moving inputs), prequant.py and synthetic.py (pre-quantized and random-weight
checkpoints), portable.py (tokenizer and adapter files other clients read). The placements:

- `whole` (one process, or replicas): every tensor is set at once; the bf16 weights are never all held,
  only one tensor at a time.
- `fsdp2`: nothing is set at load time (a placeholder stands in, so LoRA can be attached); `wrap`
  shards the meta model with `fully_shard` and then `fsdp2.fill_shards` streams the checkpoint again,
  each rank keeping only its dim-0 chunk of every parameter: the packed 4-bit bytes included.
- `fsdp1`: FSDP1 flattens and shards the model unit by unit (its `param_init_fn` gives a unit's meta
  parameters memory just before), then `fsdp1.fill_shards` fills each rank's slice of every flat
  parameter, reading only the rows that slice covers (fsdp1.py).

Quantization state (absmax, nested absmax, code, ...) is kept whole on every rank, on the `Linear4bit`
module (`module.quant_state`), where bitsandbytes finds it again after FSDP gathers the packed weight.
"""