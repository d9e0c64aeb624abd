"""Layer `util`: what every layer may use. errors.py (bad input, failed writes, exit codes), log.py
(rank-zero logging), atomic.py (write-then-rename), units.py (sizes), dtypes.py (dtype names), redact.py
(secrets out of every output), builtin.py (the tiny model and data that ship with the package), synthetic_names.py (synthetic model
and token names), libc.py (glibc's heap calls), digest.py (file SHA-256).
"""
