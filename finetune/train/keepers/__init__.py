"""The run directory's keepers: what a run writes and guards in `output.dir` while it trains. checkpoint.py
(atomic step-N checkpoints, the adapter files, resume state), runlock.py (one run per output dir),
metrics.py (metrics.jsonl and the progress line), trackers.py (the experiment trackers of
`output.report_to`), memory.py (peak memory per phase into memory.json).
"""
