"""``python -m engine``: train, score or benchmark with no Prefect and no Ray.

    python -m engine train --model DIR --data PATH --out DIR [--config YAML] [--steps N ...]
    python -m engine score --model DIR [--adapter DIR] --data PATH --out FILE.jsonl
"""

from engine.cli import main

raise SystemExit(main())
