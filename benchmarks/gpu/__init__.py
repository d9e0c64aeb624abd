"""The GPU proof (proof.py runs the stages of stages.py and methods.py, sharing harness.py; report.py writes
the page of one proof run and of benchmarks/RESULTS_GPU.md), one recipe measured on a GPU (measure.py) and
the probes the stages run in processes of their own (bytecheck, syncs). benchmarks/README.md has the table."""
