"""``python -m engine``: train or score with no Prefect and no Ray.

    python -m engine train --model DIR --data PATH --out DIR [--config YAML] [--steps N ...]
    python -m engine score --model DIR [--adapter DIR] --data PATH --out FILE.jsonl
"""

from engine.host.blas import ensure_fast_blas

ensure_fast_blas()  # Linux CPU: re-run with OpenBLAS preloaded (engine/host/blas.py)

from engine.host.command_queue import entry_point  # noqa: E402

entry_point()  # a run under a memory limit may re-run with MLX's queue capped

from engine.cli import main  # noqa: E402

raise SystemExit(main())
