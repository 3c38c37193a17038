"""Plots (PNG, matplotlib's Agg backend, written atomically): training and validation
curves per trial, the sweep metric against each swept parameter, and the figure setup the
memory sweep's Pareto plot shares. Small enough to inline in a Prefect markdown artifact
as data URIs (``inline_png``)."""

from __future__ import annotations

import base64
import itertools
import json
from pathlib import Path
from typing import Any

from engine.host.atomic import written
from tasks.board.ranked_metric import metric_value


def figure(ncols: int, size: tuple[float, float] = (5, 3.6)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(size[0] * ncols, size[1]), dpi=100,
                             squeeze=False)
    return plt, fig, list(axes[0])


def save_png(plt, fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` atomically and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with written(path) as tmp:  # a unique name: never a file of a user's
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return path


def read_metrics(adapter: str) -> list[dict[str, Any]]:
    path = Path(adapter) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def curves_png(rows: list[dict[str, Any]], metric: str, path: Path) -> Path | None:
    """Train loss and the validation ``metric`` against step, one line per trial."""
    trials = [(r["trial_id"], read_metrics(r["adapter"])) for r in rows if r.get("adapter")]
    trials = [(t, m) for t, m in trials if m]
    if not trials:
        return None
    plt, fig, (train_ax, val_ax) = figure(2)
    for trial, records in trials:
        train = [r for r in records if r.get("split") == "train" and "loss" in r]
        val = [r for r in records if r.get("split") == "valid" and metric in r]
        train_ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=trial)
        val_ax.plot([r["step"] for r in val], [r[metric] for r in val], "o-", label=trial)
    train_ax.set(title="training loss", xlabel="step")
    val_ax.set(title=metric, xlabel="step")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
    val_ax.legend(fontsize=7)
    return save_png(plt, fig, path)


def rewards_png(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """A GRPO sweep's reward curves (TRL's names): each trial's training ``reward`` against
    step, ± its ``reward_std`` shaded, and ``frac_reward_zero_std`` (the groups that carried
    no signal); None where no trial reported a reward."""
    trials = [(r["trial_id"], [m for m in read_metrics(r["adapter"])
                               if m.get("split") == "train" and "reward" in m])
              for r in rows if r.get("adapter")]
    trials = [(t, m) for t, m in trials if m]
    if not trials:
        return None
    plt, fig, (reward_ax, flat_ax) = figure(2)
    for trial, records in trials:
        steps = [r["step"] for r in records]
        mean = [r["reward"] for r in records]
        spread = [r.get("reward_std", 0.0) for r in records]
        line, = reward_ax.plot(steps, mean, ".-", label=trial)  # a lone report: a dot
        reward_ax.fill_between(steps, [m - s for m, s in zip(mean, spread, strict=True)],
                               [m + s for m, s in zip(mean, spread, strict=True)],
                               color=line.get_color(), alpha=0.15)
        flat_ax.plot(steps, [r.get("frac_reward_zero_std", 0.0) for r in records], ".-",
                     label=trial)
    reward_ax.set(title="reward (± reward_std)", xlabel="step")
    flat_ax.set(title="frac_reward_zero_std", xlabel="step", ylim=(-0.05, 1.05))
    for ax in (reward_ax, flat_ax):
        ax.grid(alpha=0.3)
    flat_ax.legend(fontsize=7)
    return save_png(plt, fig, path)


def metric_vs_params_png(rows: list[dict[str, Any]], metric: str, params: list[str],
                         path: Path) -> Path | None:
    """The best ``metric`` of each completed trial against each swept parameter."""
    done = [r for r in rows if r.get("status") == "completed"
            and metric_value(r, metric) is not None]
    if not done or not params:
        return None
    plt, fig, axes = figure(len(params))
    for ax, param in zip(axes, params, strict=True):
        xs = [r.get(param) for r in done]
        ys = [metric_value(r, metric) for r in done]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
        ax.scatter(xs if numeric else [str(x) for x in xs], ys)
        if numeric:
            number_axis(ax, [float(x) for x in xs])
        ax.set(xlabel=param.removeprefix("param/"), ylabel=metric)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    for ax in axes:
        thin_ticks(fig, ax)
    return save_png(plt, fig, path)


# A positive parameter whose values differ by this factor or more (learning rates
# 1e-4..3e-4, ranks 4..16) is drawn on a log axis; closer values (0.5..1.0) stay linear.
LOG_SPAN = 2.5


def compact(x: float, _pos: int | None = None) -> str:
    """A short tick label: ``3e-4``, ``1.5e-4``, ``0.1``, ``16``, ``2e+04``."""
    if x == 0 or 1e-2 <= abs(x) < 1e4:
        return f"{x:.3g}"
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def number_axis(ax, xs: list[float]) -> None:
    """Log x axis for positive values spanning ``LOG_SPAN`` or more; ticks at the swept
    values when they are few (a grid), 1-2-5 per decade otherwise; compact labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    values = sorted(set(xs))
    if values[0] > 0 and values[-1] / values[0] >= LOG_SPAN:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(values) if len(values) <= 6
                                   else LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_formatter(FuncFormatter(compact))


def thin_ticks(fig, ax) -> None:
    """Drop every other x tick until no two drawn tick labels overlap."""
    for _ in range(8):
        boxes = sorted((box.x0, box.x1) for _, box in drawn_xlabels(fig, ax))
        if len(boxes) < 3 or all(a[1] + 2 < b[0] for a, b in itertools.pairwise(boxes)):
            return
        ax.set_xticks([loc for loc, _ in drawn_xlabels(fig, ax)][::2])


def drawn_xlabels(fig, ax) -> list[tuple[float, Any]]:
    """(position, pixel box) of each non-empty x tick label inside the axis limits."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    lo, hi = sorted(ax.get_xlim())
    slack = (hi - lo) * 1e-9
    return [(t.get_loc(), t.label1.get_window_extent(renderer))
            for t in ax.xaxis.get_major_ticks()
            if lo - slack <= t.get_loc() <= hi + slack and t.label1.get_text()]


def inline_png(path: Path | None, alt: str) -> str:
    """A markdown image with the PNG inlined (artifacts cannot link local files)."""
    if path is None:
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f"![{alt}](data:image/png;base64,{data})\n"

