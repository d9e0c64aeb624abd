"""The CPU rows of `python -m benchmarks` (one module each, `run(**settings) -> dict`), the report they write
(RESULTS.md: report.py, report_details.py) and CPU measurements run on their own (adapter_methods,
preference). benchmarks/README.md lists every row with its command."""
