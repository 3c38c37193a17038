"""``kind: memory`` sweeps: peak GB and tokens/s of each engine setting, as a Pareto front.

Every grid point (typically ``segment_size`` × ``head_chunk`` × ``prefix_share``) runs real
training steps on the first ``probe_batches`` micro-batches of the dataset — its real
length distribution — in one fresh process on one GPU or slot (``engine/train/probe.py``).
Outputs under the sweep directory: ``memory.parquet`` (one row per setting),
``memory.md`` (the table, Pareto-optimal rows marked) and ``memory.png`` (peak vs
throughput with the front drawn). A setting is Pareto-optimal when no other one uses
less memory and trains faster at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.host.atomic import atomic_write_text
from tasks.board.plots import figure, save_png
from tasks.board.results_table import write_results
from tasks.nodes.placement import Placement
from tasks.sweep.sweep_spec import SweepSpec

LABEL_KEYS = ("segment_size", "head_chunk", "prefix_share", "inflight")


def _measure(config: dict[str, Any], variants: list[dict[str, Any]], batches: int
             ) -> list[dict[str, Any]]:
    from engine.settings.config import TrainConfig
    from engine.train.probe import probe_steps

    return probe_steps(TrainConfig().replace(**config), variants, batches=batches)


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with ``pareto`` set: no other row has lower peak and higher tokens/s at once."""
    ok = [r for r in rows if "error" not in r]
    for r in rows:
        r["pareto"] = "error" not in r and not any(
            o is not r and o["peak_gb"] <= r["peak_gb"] and o["tokens_per_sec"] >=
            r["tokens_per_sec"] and (o["peak_gb"] < r["peak_gb"] or
                                     o["tokens_per_sec"] > r["tokens_per_sec"]) for o in ok)
    return rows


def label(row: dict[str, Any], swept: list[str]) -> str:
    return " ".join(f"{k}={row[k]}" for k in swept) or "default"


def run_memory_sweep(spec: SweepSpec, out: Path, placement: Placement | None = None
                     ) -> list[dict[str, Any]]:
    """Measure every grid point of ``spec``; write memory.parquet/.md/.png under ``out``
    (held as the sweep's own folder meanwhile: tasks/sweep/run.py, ``claim_sweep``)."""
    from engine.data.unpaired import refuse_unpaired
    from tasks.sweep.run import claim_sweep

    refuse_unpaired(Path(spec.data), "a memory sweep probes pairs")
    with claim_sweep(spec, Path(out)):
        return _run_memory_sweep(spec, Path(out), placement)


def _run_memory_sweep(spec: SweepSpec, out: Path, placement: Placement | None
                      ) -> list[dict[str, Any]]:
    import ray

    placement = placement or Placement()
    out = Path(out)
    swept = [k for k in LABEL_KEYS if k in spec.grid] + sorted(set(spec.grid) - set(LABEL_KEYS))
    variants = [{k: params[k] for k in swept} for params in spec.points()]
    base = {**spec.fixed, "model": spec.model, "data": spec.data, "out": str(out / "probe")}
    measure = placement.fresh_task(_measure)
    rows = pareto(ray.get(measure.remote(base, variants, spec.probe_batches)))
    for r in rows:
        r["setting"] = label(r, swept)
    out.mkdir(parents=True, exist_ok=True)
    write_results(rows, out / "memory.parquet")
    atomic_write_text(out / "memory.md", markdown(spec, rows))
    plot(rows, out / "memory.png", f"{spec.name}: peak memory vs throughput")
    return rows


def markdown(spec: SweepSpec, rows: list[dict[str, Any]]) -> str:
    lines = [f"# Memory sweep `{spec.name}`", "",
             f"{spec.probe_batches} real micro-batches of batch_size "
             f"{spec.fixed.get('batch_size', 'default')} per setting; ★ = Pareto-optimal.", "",
             "| setting | peak GB | tokens/s | step s | shared rate | |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r.get("peak_gb", float("inf"))):
        if "error" in r:
            lines.append(f"| {r['setting']} | - | - | - | - | {r['error'][:80]} |")
        else:
            lines.append(f"| {r['setting']} | {r['peak_gb']:.3f} | {r['tokens_per_sec']:,.0f} | "
                         f"{r['step_s']:.3f} | {r['shared_rate']:.2f} | "
                         f"{'★' if r['pareto'] else ''} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Scatter of peak GB vs tokens/s, every point labelled, the Pareto front joined."""
    ok = [r for r in rows if "error" not in r]
    plt, fig, (ax,) = figure(1, (8, 5))
    ax.scatter([r["peak_gb"] for r in ok], [r["tokens_per_sec"] for r in ok], color="#888")
    front = sorted((r for r in ok if r["pareto"]), key=lambda r: r["peak_gb"])
    ax.plot([r["peak_gb"] for r in front], [r["tokens_per_sec"] for r in front], "o-",
            color="#c0392b", label="Pareto front")
    for r in ok:
        ax.annotate(r["setting"], (r["peak_gb"], r["tokens_per_sec"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("peak memory (GB)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    return save_png(plt, fig, path)
