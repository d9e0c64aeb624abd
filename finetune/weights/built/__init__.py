"""Bases built here rather than read from a hub: synthetic random-weight models from a config (synthetic.py) and
pre-quantized `*-bnb-4bit` checkpoints written from a recipe's base (prequant.py)."""
