"""Data: rows -> token ids with loss labels -> batches (dynamically padded, or packed without padding).

sources.py reads a recipe's sources (files through readers.py, hub, builtin) and checks each row against
its format (formats.py); encode.py turns one row into input_ids and labels; prepare.py reads, splits,
mixes, encodes (cached) and filters everything into train and eval examples; batching.py collates them.
"""
