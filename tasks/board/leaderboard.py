"""The leaderboard: every trial ranked by the sweep's metric, the base model beside them, and
the best adapter copied in mlx-lm's format (to best-adapter/; a GGUF is an export:
engine/model/export.py).

Ranked rows are the completed trials, best first by the sweep metric (its best value during
training on the validation split, ``best/<metric>``); completed trials without one (an
empty valid split), degenerate (collapsed: zero gradients, or accuracy far below chance
on either split), pruned, failed and cancelled trials follow, unranked, each with its
reason under the table, so nothing is silently dropped. Validation and test accuracy are
separate columns: ranking chose on validation, so test (rows no choice ever read) is the
number to report; a dataset without valid or test rows shows "-" there and says why
under the table. The ``base`` row is the untrained model
under the same evaluation, the number every adapter is read against: each other row
carries its paired test against it on the same rows (tasks/eval/paired.py), and every
small-sample share its n and 95 % interval. A sweep may rank on a generation score
(``rank_by: gen/valid/<label>``, higher better) instead of a training metric. Written as
``leaderboard.parquet`` (all columns) and ``leaderboard.md`` (the readable few).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from engine.host.atomic import atomic_write_text, write_atomic
from engine.host.outputs import RefusedOutput
from engine.losses import LOSSES, shared_metrics, validation_metrics
from engine.model.source import source_kind
from engine.settings.config import DEFAULT_LOSS
from engine.settings.metric_order import MODES, rank_key
from tasks.board.ranked_metric import metric_value
from tasks.board.results_table import write_results
from tasks.eval.degenerate import below_chance
from tasks.eval.paired import against_base, board_row
from tasks.eval.scorers import RESERVED

ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")
EVAL_COLUMNS = ("eval/valid/logps/accuracies", "eval/test/logps/accuracies",
                "eval/test/logps/margin", "eval/test/loss", "eval/test/nll_loss")


def rank_trials(results: list[dict[str, Any]], evals: dict[str, dict[str, Any]], metric: str,
                mode: str, base: dict[str, Any] | None = None,
                soup: dict[str, Any] | None = None,
                tie: tuple[str, str] = ("val/loss", "min")) -> list[dict[str, Any]]:
    """Trials with their evaluations, ranked (1 = best), equal ones by the training metric
    ``tie`` (metric, mode: a generation score of 64 prompts ties often); unranked ones
    after; then the soup (no training metric of its own: read its eval columns) and the
    base model."""
    rows = [_held_out_check({**r, **evals.get(r["trial_id"], {})}) for r in results]

    def score(r: dict[str, Any]) -> float:
        return rank_key(metric_value(r, metric), mode)

    done = [r for r in rows if r["status"] == "completed"]
    ranked = sorted((r for r in done if math.isfinite(score(r))),
                    key=lambda r: (score(r), rank_key(metric_value(r, tie[0]), tie[1])))
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    # A completed trial without the metric (an empty valid split) has nothing to rank by.
    unranked = [{**r, "rank": None, "reason": r.get("reason") or f"not ranked: no {metric} "
                 "in training (an empty valid split reports none)"}
                for r in done if not math.isfinite(score(r))]
    rest = unranked + [{**r, "rank": None} for r in rows if r["status"] != "completed"]
    tail = [{"trial_id": "soup", "status": "soup", "rank": None, **soup}] if soup else []
    compared = [{**board_row(r), **against_base(r, base)} for r in ranked + rest + tail]
    return compared + ([{"trial_id": "base", "status": "baseline", "rank": None,
                         **board_row(base)}] if base else [])


def _held_out_check(row: dict[str, Any]) -> dict[str, Any]:
    """A completed trial whose valid or test accuracy is far below chance is degenerate."""
    reason = next(filter(None, (below_chance(row.get(f"eval/{s}/logps/accuracies"),
                                             row.get(f"eval/{s}/rows"), f"{s} accuracy")
                                for s in ("test", "valid"))), "")
    if row["status"] == "completed" and reason:
        return {**row, "status": "degenerate", "reason": reason}
    return row


def check_leaderboard_inputs(sweep_dir: Path, model: str, data: str, metric: str,
                            mode: str | None) -> None:
    """Raise ValueError or FileNotFoundError (one line, naming the path or option) unless
    ``sweep_dir`` holds a finished sweep's results and ``data`` has rows to evaluate on:
    before any cluster or flow starts."""
    from engine.data.shards import check_dataset
    from engine.data.unpaired import refuse_unpaired
    from tasks.eval.evaluate import held_out_problem

    refuse_unpaired(Path(data), "the leaderboard scores preference pairs")
    if not (Path(sweep_dir) / "results.parquet").is_file():
        raise FileNotFoundError(f"{sweep_dir}: no results.parquet; give the folder a "
                                "finished `pomona sweep` wrote (its --out)")
    if not metric.startswith(("val/", "gen/valid/")):
        raise ValueError(f"--metric {metric!r}: expected a validation metric such as "
                         "val/loss or val/rewards/accuracies, or a generation score "
                         "gen/valid/<scorer label>")
    if mode is not None and mode not in MODES:
        raise ValueError(f"--mode {mode!r}: expected min or max")
    if mode == "min" and metric.startswith("gen/"):
        raise ValueError(f"--mode min: {metric} is a score, ranked higher first; leave "
                         "--mode out")
    losses = {r for r in pq.read_table(Path(sweep_dir) / "results.parquet").to_pydict()
              .get("param/loss", []) if r}
    if metric.startswith("val/"):
        check_reported(metric, losses)
    source_kind(model)  # a local path that is not there; a repo id is mlx-lm's
    if not Path(data).exists():
        raise FileNotFoundError(f"--data {data}: no such dataset")
    if Path(data).is_dir():
        check_dataset(Path(data))  # edited since tokenize, or split the old way: said now
    if (problem := held_out_problem(data)) is not None:
        raise ValueError(problem)


def check_reported(metric: str, losses: set[str]) -> None:
    """A validation ``metric`` the sweep's ``losses`` report, on one scale (ValueError);
    an unknown one would rank nothing and overwrite the board."""
    shared = shared_metrics(losses)
    if len(losses) > 1 and metric not in shared:  # each loss's own scale
        raise ValueError(f"--metric {metric}: not comparable across the sweep's losses "
                         f"{sorted(losses)}; rank on one of {', '.join(shared)}")
    for loss in sorted(losses or {DEFAULT_LOSS.kind}):
        if loss in LOSSES and metric not in (names := validation_metrics(LOSSES[loss]())):
            raise ValueError(f"--metric {metric}: the sweep's loss {loss} does not report "
                             f"it; it reports {', '.join(names)}")


def ranked_on(metric: str) -> str:
    """The board's first words: what it ranked on."""
    if metric.startswith("gen/"):
        return (f"Ranked on {metric} (a generation score on the valid split, higher first; "
                "ties by the training metric)")
    return f"Ranked on validation ({metric}, its best in training)"


def why_unranked(rows: list[dict[str, Any]], metric: str) -> str | None:
    """Why a sweep's ``rows`` rank no trial (every one failed, or none reported
    ``metric``), or None when at least one can be ranked."""
    if not rows:
        return "no trial ran"
    done = [r for r in rows if r["status"] == "completed"]
    if not done:
        counts = Counter(r["status"] for r in rows)
        return (f"no trial completed ({', '.join(f'{n} {s}' for s, n in counts.items())}); "
                "their reasons are in the table above")
    values = [metric_value(r, metric) for r in done]
    if all(v is None or not math.isfinite(v) for v in values):
        return (f"no trial can be ranked: none of the {len(done)} completed trials reported "
                f"a finite {metric} (is the dataset's valid split empty?)")
    return None


def swept_params(rows: list[dict[str, Any]]) -> list[str]:
    """The ``param/*`` columns whose value differs between trials."""
    names = sorted({k for r in rows for k in r if k.startswith("param/")})
    return [n for n in names if len({str(r.get(n)) for r in rows if n in r}) > 1]


def markdown(rows: list[dict[str, Any]], metric: str, title: str) -> str:
    """Every column: leaderboard.md, and the UI's full-table artifact."""
    params = swept_params([r for r in rows if r.get("status") not in ("baseline", "soup")])
    labels = gen_labels(rows)
    gens = [f"gen/{s}/{x}" for x in labels for s in ("valid", "test")]
    cols = ["rank", "trial", "status", metric, *EVAL_COLUMNS, "test acc [95% CI]",
            "test acc vs base p", *(f"{g} [95% CI]" for g in gens),
            *(f"gen/test/{x} vs base p" for x in labels), "peak GB",
            "tokens/s", "s", *(p.removeprefix("param/") for p in params)]
    body = [[str(r.get("rank") or ""), r["trial_id"], r["status"],
             _num(metric_value(r, metric)), *(_num(r.get(c)) for c in EVAL_COLUMNS),
             with_interval(r, "eval/test/logps/accuracies", 3),
             _num(r.get("vs_base/test/logps/accuracies/p"), 3),
             *(with_interval(r, g, 3) for g in gens),
             *(_num(r.get(f"vs_base/test/gen/{x}/p"), 3) for x in labels),
             _num(r.get("peak_memory_gb"), 2), _num(r.get("tokens_per_sec"), 0),
             _num(r.get("duration_s"), 0), *(str(r.get(p, "")) for p in params)]
            for r in rows]
    intro = (f"{ranked_on(metric)}; eval/test/* is the test split, which no choice read: "
             "the number to report.")
    return _page(title, intro, cols, body, rows)


def gen_labels(rows: list[dict[str, Any]], split: str = "test") -> list[str]:
    """The scorer labels the rows carry generation scores of (``gen/<split>/<label>``; the
    token counts beside them are no scores)."""
    parts = (k.split("/") for r in rows for k in r if k.startswith(f"gen/{split}/"))
    return list(dict.fromkeys(p[2] for p in parts if len(p) == 3 and p[2] not in RESERVED))


def with_interval(row: dict[str, Any], name: str, digits: int = 2) -> str:
    """``0.64 [.52–.75]``: a share with its 95 % interval (``name/low``, ``name/high``),
    the bounds without their leading zero (a board column stays narrow)."""
    value, low, high = row.get(name), row.get(f"{name}/low"), row.get(f"{name}/high")
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if low is None or high is None:
        return f"{value:.{digits}f}"

    def bound(x: float) -> str:
        text = f"{x:.{digits}f}"
        return text[1:] if text.startswith("0.") else text

    return f"{value:.{digits}f} [{bound(low)}–{bound(high)}]"


def _n(rows: list[dict[str, Any]], name: str) -> str:
    """`` n=220`` when the rows were scored on one number of rows, else ``""``."""
    counts = {r.get(name) for r in rows if r.get(name)}
    return f", n={counts.pop()}" if len(counts) == 1 else ""


def compact_markdown(rows: list[dict[str, Any]], metric: str, title: str) -> str:
    """The few columns the CLI prints (rank, trial, the searched parameters, validation and
    test preference accuracy and each generation score on test with 95 % intervals): the
    UI's leading artifact, narrow enough for a 1400 px browser; ``markdown`` has all (and
    tokens/s)."""
    params = swept_params([r for r in rows if r.get("status") not in ("baseline", "soup")])
    labels = gen_labels(rows)
    cols = ["#", "trial", *(p.removeprefix("param/") for p in params), "val acc",
            "test acc", *(f"test {x}" for x in labels)]
    body = [[_place(r), r["trial_id"], *(_param(r.get(p)) for p in params),
             _num(r.get("eval/valid/logps/accuracies"), 3),
             with_interval(r, "eval/test/logps/accuracies"),
             *(with_interval(r, f"gen/test/{x}") for x in labels)]
            for r in rows]
    counts = "; ".join(f"{what}{n}" for what, n in (
        ("test acc: preference (chosen beats rejected)", _n(rows, "eval/test/rows")),
        *((f"test {x}: answers scored by {x}", _n(rows, f"gen/test/{x}/n")) for x in labels)))
    intro = (f"{ranked_on(metric)}; the test split, which no choice read, gives "
             f"the numbers to report, each a mean [95 % interval] ({counts}). Every "
             "column: leaderboard.md.")
    return _page(title, intro, cols, body, rows) + versus_base(rows)


def versus_base(rows: list[dict[str, Any]]) -> str:
    """One line for the best adapter against the base on the test split: each figure's
    paired test, and whether the difference is significant."""
    from tasks.eval.paired import read_paired

    best = next((r for r in rows if r.get("rank") == 1), None)
    if best is None:
        return ""
    lines = []
    for metric in ("logps/accuracies", *(f"gen/{x}" for x in gen_labels(rows))):
        result = read_paired(best, "test", metric)
        if result is not None:
            what = "preference accuracy" if metric == "logps/accuracies" else metric
            lines.append(f"- best ({best['trial_id']}) against base, test {what}: "
                         f"{result.text()}")
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def _page(title: str, intro: str, cols: list[str], body: list[list[str]],
          rows: list[dict[str, Any]]) -> str:
    """A markdown page: title, intro, the table, then a note per empty split and reason."""
    lines = [f"# {title}", "", intro, "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols), *("| " + " | ".join(cells) + " |" for cells in body)]
    notes = [f"- {split} split: {missing}" for split in ("valid", "test")
             if (missing := next((r[f"eval/{split}/missing"] for r in rows
                                  if r.get(f"eval/{split}/missing")), None))]
    notes += [f"- {r['trial_id']}: {r['reason']}" for r in rows if r.get("reason")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _place(row: dict[str, Any]) -> str:
    """Rank, or why there is none (a baseline and a soup need no word)."""
    if row.get("rank"):
        return str(row["rank"])
    return "" if row.get("status") in ("soup", "baseline") else str(row.get("status", ""))


def _param(value: Any) -> str:
    return "-" if value is None else format(value, "g") if isinstance(value, float) else str(value)


def _signed(value: Any) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:+.3f}"


def _num(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.{digits}f}" if digits else f"{value:,.0f}"


def write_leaderboard(rows: list[dict[str, Any]], out: Path, metric: str, title: str
                      ) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md = out / "leaderboard.md"
    atomic_write_text(md, markdown(rows, metric, title))
    return write_results(rows, out / "leaderboard.parquet"), md


def copy_best(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Copy the rank-1 adapter to ``out/best-adapter`` (mlx-lm's files). Only the files the
    copy writes (SOURCE and ``ADAPTER_FILES``) are replaced, each atomically; anything
    else a user put in the folder (a README, a tokenizer) stays as it was."""
    best = next((r for r in rows if r.get("rank") == 1 and r.get("adapter")), None)
    if best is None:
        return None
    target = out / "best-adapter"
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise RefusedOutput(f"{target}: not a folder; refusing to replace it with the best "
                            "adapter. Move it out of the way")
    if target.exists() and not (target / "SOURCE").is_file():  # SOURCE: the copy's mark
        raise RefusedOutput(f"{target}: not a best adapter Pomona copied (no SOURCE file); "
                            "refusing to replace it. Move it out of the way")
    target.mkdir(exist_ok=True)  # mode per the umask: readable like any folder
    # SOURCE first: a copy killed midway still leaves a folder marked as Pomona's
    atomic_write_text(target / "SOURCE", f"{best['trial_id']}\n")
    for name in ADAPTER_FILES:
        write_atomic(target / name,
                     lambda tmp, name=name: shutil.copyfile(Path(best["adapter"]) / name, tmp))
    return target


def answer_samples(rows: list[dict[str, Any]], count: int = 8) -> list[dict[str, Any]]:
    """The first ``count`` held-out test prompts (valid without a test split): the chosen
    response, the base model's and the best adapter's answers and their scores (the
    first scorer's), from their generations.jsonl; [] without both."""
    def read(row: dict[str, Any] | None) -> list[dict[str, Any]]:
        path = Path(row["generations"]) if row and row.get("generations") else None
        if path is None or not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    base = read(next((r for r in rows if r["trial_id"] == "base"), None))
    best = {g["id"]: g for g in read(next((r for r in rows if r.get("rank") == 1), None))}
    split = "test" if any(g["split"] == "test" for g in base) else "valid"
    out = []
    for g in [g for g in base if g["split"] == split and g["id"] in best][:count]:
        label = next(iter(g["scores"]), None)
        out.append({"prompt": g["prompt"][-120:], "chosen": g["chosen"],
                    "base answer": g["generated"], f"base {label}": g["scores"].get(label),
                    "best answer": best[g["id"]]["generated"],
                    f"best {label}": best[g["id"]]["scores"].get(label)})
    return out
