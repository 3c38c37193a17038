"""``python -m benchmarks check``: the load check on a model, its figures and time, and proof
that it still refuses a broken decomposition.

Loads the model as the trainer does (LoRA at the trainer's defaults), runs the load check
(engine/check/load_check.py) and prints its figures: the float32 copy's logits and gradient
errors, the native dtype's distance from float32 (segmented and plain autograd), seconds.
``--mutate`` breaks the family's Stack first (a sliding window dropped, the embedding
scale dropped) and reports whether the check refused it, which it must.

    python -m benchmarks check --model DIR [--mutate drop-window|embed-scale] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from engine.host.parsers import OneLineParser

MUTATIONS = {
    "drop-window": ("window", lambda self, i: None),
    "embed-scale": ("embed", lambda self, tokens: self.inner.embed_tokens(tokens)),
}


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m benchmarks check", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Model directory, .gguf file or repo id.")
    p.add_argument("--mutate", action="append", choices=sorted(MUTATIONS), default=[],
                   help="Break the stack this way first (repeatable: one check each).")
    p.add_argument("--json", action="store_true", help="One JSON object on stdout.")
    return p


def run_check(model: Any, mutation: str) -> dict[str, Any]:
    """Whether the load check refused the stack broken by ``mutation``."""
    from engine.check.load_check import checked_stack
    from engine.model.arch import make_stack

    cls = type(make_stack(model))
    name, broken = MUTATIONS[mutation]
    saved = cls.__dict__.get(name)
    setattr(cls, name, broken)
    started = time.perf_counter()
    try:
        checked_stack(model)
        refused = None
    except ValueError as err:
        refused = str(err)
    finally:
        if saved is None:
            delattr(cls, name)
        else:
            setattr(cls, name, saved)
    return {"mutation": mutation, "refused": refused is not None, "error": refused,
            "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    from engine.settings.config import TrainConfig
    from engine.train.prepared import prepare_training

    a = parser().parse_args(argv)
    started = time.perf_counter()
    prepared = prepare_training(TrainConfig(model=a.model))  # the check runs once in it
    loaded = time.perf_counter() - started - prepared.check["seconds"]
    rows = [{"check": prepared.check}]
    rows += [{"check": run_check(prepared.model, m)} for m in a.mutate]
    result = {"model": a.model, "device": str(mx.default_device()), "load_s": loaded,
              "rows": rows}
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for row in rows:
            print(json.dumps(row))
    return 0 if all(r["check"].get("refused", True) for r in rows[1:]) else 1
