"""The metric-vs-parameter plot: log axis for spread-out positive values, no overlapping
tick labels (issue 14, item 14: a learning-rate axis printed 0.000100 … 0.000300 into each
other). Label boxes come from matplotlib's own renderer, as drawn in the PNG."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tasks.board import plots

pytestmark = pytest.mark.unit


def drawn_axis(monkeypatch, xs: list[float], tmp_path: Path):
    """(x scale, visible tick labels) of the figure metric_vs_params_png saves for one swept
    parameter with values ``xs``, read just before it is written (and closed)."""
    seen = {}
    save = plots.save_png

    def keep(plt, fig, path):
        fig.tight_layout()  # as save_png lays it out
        fig.canvas.draw()
        [ax] = fig.axes
        seen.update(scale=ax.get_xscale(), labels=visible_labels(fig, ax))
        return save(plt, fig, path)

    monkeypatch.setattr(plots, "save_png", keep)
    rows = [{"status": "completed", "trial_id": f"t{i}", "param/learning_rate": x,
             "best/val/loss": 5.0 - i / 10} for i, x in enumerate(xs)]
    png = plots.metric_vs_params_png(rows, "val/loss", ["param/learning_rate"],
                                     tmp_path / "params.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    return seen["scale"], seen["labels"]


def visible_labels(fig, ax) -> list[tuple[str, float, float]]:
    """(text, left, right) in pixels of each x tick label drawn inside the axis."""
    renderer = fig.canvas.get_renderer()
    lo, hi = sorted(ax.get_xlim())
    slack = (hi - lo) * 1e-6
    out = []
    for tick in ax.xaxis.get_major_ticks():
        if lo - slack <= tick.get_loc() <= hi + slack and tick.label1.get_visible() \
                and tick.label1.get_text():
            box = tick.label1.get_window_extent(renderer)
            out.append((tick.label1.get_text(), box.x0, box.x1))
    return sorted(out, key=lambda label: label[1])


@pytest.mark.parametrize(("xs", "scale"), [
    ([1e-4, 2e-4, 3e-4], "log"),                    # the grid
    ([3e-4, 1e-3], "log"),                          # docs/images/leaderboard-artifact.png
    ([1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 4e-5, 2e-4, 6e-3], "log"),  # random search
    ([2.0e-4, 2.1e-4, 2.2e-4, 2.3e-4], "linear"),   # close values: linear, still readable
])
def test_parameter_axis_scale_and_labels_do_not_overlap(monkeypatch, tmp_path, xs,
                                                        scale) -> None:
    """Catches a linear axis for learning rates and tick labels drawn over each other."""
    drawn_scale, labels = drawn_axis(monkeypatch, xs, tmp_path)
    assert drawn_scale == scale
    assert len(labels) >= 2, labels
    overlaps = [(a[0], b[0]) for a, b in itertools.pairwise(labels) if a[2] >= b[1]]
    assert not overlaps, f"overlapping tick labels {overlaps} in {labels}"


@pytest.mark.parametrize(("x", "text"), [(3e-4, "3e-4"), (1.5e-4, "1.5e-4"), (0.1, "0.1"),
                                         (16, "16"), (2.5e-5, "2.5e-5"), (0, "0")])
def test_compact_tick_labels(x: float, text: str) -> None:
    """Catches six-decimal labels (0.000300) coming back."""
    assert plots.compact(x) == text
