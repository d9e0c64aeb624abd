"""FSDP over the streamed base: what each FSDP version needs before `accelerator.prepare` wraps the model
(`before_wrap`), and each rank's part of the base streamed into the shards it made (`fill_shards`). The entry
points are in fsdp.py; fsdp2.py and fsdp1.py each own their version's before-wrap and fill."""
