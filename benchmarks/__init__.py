"""Pomona's benchmarks, one home: every comparison measured side by side in one run.

One front end, ``python -m benchmarks KIND ...`` (``pomona bench KIND ...`` is the same);
``python -m benchmarks --help`` lists the kinds. It needs neither Prefect nor Ray, so it
runs on a GPU machine that has only MLX (and torch, for TRL's rows). Imports point
benchmarks → tasks → engine: nothing below imports this package.
"""
