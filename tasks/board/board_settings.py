"""What one leaderboard is: its title and what ranks it (``Ranking``), and what it makes
besides the ranking (``BoardOptions``): the soup, the fused model, the GGUF. The pipeline
builds them from the spec, ``pomona leaderboard`` from its flags; the rank stage takes
them whole."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.export import ExportSettings
from tasks.board.ranked_metric import rank_mode


@dataclass(frozen=True)
class Ranking:
    """``title``: the board's; ``by``/``mode``: what orders its rows (a validation metric or
    a generation score, ``gen/…`` higher first); ``metric``/``metric_mode``: the training
    metric the plots show and that breaks ties."""

    title: str
    by: str = "val/loss"
    mode: str = "min"
    metric: str = "val/loss"
    metric_mode: str = "min"

    @classmethod
    def of(cls, title: str, metric: str, mode: str | None) -> Ranking:
        """A board ranked by ``metric`` alone (``pomona leaderboard``): a validation metric
        trains and breaks ties as it ranks; a generation score is broken by val/loss."""
        mode = mode or "min"
        trained = (metric, mode) if metric.startswith("val/") else ("val/loss", "min")
        return cls(title, metric, rank_mode(metric, mode), *trained)


@dataclass(frozen=True)
class BoardOptions:
    """``soup_k``: average the top k adapters (below 2: no soup); ``fuse``: also fuse the
    best adapter into the base; ``export``: also write it as a GGUF (the spec's
    ``export``); ``start``: the warm start the pipeline's own stage trained and every
    trial began from, which the base row is evaluated with: what training added is read
    against where it started."""

    soup_k: int = 2
    fuse: bool = False
    export: ExportSettings | None = None
    start: str | None = None
