"""``pomona sweep SPEC``: connect to (or start) Ray, run the sweep with a live progress
display (trials done / running / failed, best so far), print the results table."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.host.atomic import FULL
from engine.host.outputs import RefusedOutput
from engine.settings.metric_order import beats
from tasks.board.leaderboard import why_unranked
from tasks.board.ranked_metric import metric_value
from tasks.nodes.cluster import Cluster
from tasks.nodes.ray_session import RayAddressError
from tasks.sweep.memory_sweep import run_memory_sweep
from tasks.sweep.references import make_references
from tasks.sweep.run import check_inputs, check_sweep_out, plan_line, run_sweep
from tasks.sweep.scheduler import TrialsInterrupted
from tasks.sweep.spec_file import load_spec
from tasks.sweep.spec_rules import check_kind
from tasks.sweep.sweep_spec import SpecError, SweepSpec
from tasks.track.report_to import with_report_to


class SweepProgress:
    """Turns the sweep's events into one rich progress bar and log lines."""

    def __init__(self, console: Console, spec: SweepSpec):
        self.console, self.spec = console, spec
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                                 TimeElapsedColumn(), console=console, transient=False)
        self.task = self.progress.add_task(f"sweep {spec.name}", total=None, status="")
        self.counts = {"running": 0, "completed": 0, "failed": 0, "pruned": 0, "cached": 0,
                       "degenerate": 0, "cancelled": 0}
        self.best: float | None = None
        self.lock = threading.Lock()

    def __call__(self, kind: str, summary: dict[str, Any]) -> None:
        with self.lock:
            if kind == "plan":
                self.progress.update(self.task, total=summary["trials"])
                cached = summary.get("cached", 0)
                self.counts["cached"] = cached
                self.progress.advance(self.task, cached)
                self.console.print(plan_line(summary))
            elif kind == "started":
                self.counts["running"] += 1
            elif kind in ("lost", "retry"):
                if kind == "lost":
                    self.counts["running"] -= 1
                    self.console.print(f"[yellow]{summary['trial_id']}: process lost "
                                       f"({summary.get('reason', '')}); retrying")
            elif kind == "finished":
                self._finished(summary)
            self.progress.update(self.task, status=self._status())

    def _finished(self, summary: dict[str, Any]) -> None:
        self.counts["running"] = max(0, self.counts["running"] - 1)
        status = summary["status"]
        self.counts[status if status in self.counts else "failed"] += 1
        self.progress.advance(self.task)
        value = metric_value(summary, self.spec.metric)
        if status == "completed" and (self.best is None or beats(value, self.best,
                                                                 self.spec.mode)):
            self.best = value
        note = f" {summary.get('reason')}" if summary.get("reason") else ""
        self.console.print(f"{summary['trial_id']}: {status}{note}")

    def _status(self) -> str:
        c = self.counts
        best = f" best {self.spec.metric} {self.best:.4f}" if self.best is not None else ""
        extra = "".join(f" · {k} {c[k]}" for k in ("degenerate", "cancelled") if c[k])
        return (f"running {c['running']} · done {c['completed']} · pruned {c['pruned']} · "
                f"failed {c['failed']}{extra}{best}")


def run_sweep_cli(console: Console, spec_path: Path, out: Path | None, cluster: Cluster,
                  use_prefect: bool = False, report_to: list[str] | None = None) -> None:
    try:
        spec = with_report_to(load_spec(spec_path), report_to)
        check_kind(spec.kind, spec.search, [], spec.report_to)  # --report-to: none in memory
    except (ValueError, FileNotFoundError) as err:  # SpecError is a ValueError
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(code=2) from err
    out = out or Path("runs") / spec.name
    placement = cluster.placement
    try:
        check_inputs(spec)  # before Ray starts: a mistyped path costs no cluster start-up
        check_sweep_out(spec, out)  # and an --out not ours, busy or read-only none either
        if spec.kind == "memory":
            with cluster.session():
                rows = run_memory_sweep(spec, out, placement)
            console.print(memory_table(rows, out))
            return
        if use_prefect:
            from cli.prefect_ui import prefect_api  # ApiGone: a RuntimeError, one line
            from flows.sweep_flow import sweep_flow

            with prefect_api(out):
                sweep_flow(str(spec_path), str(out), cluster, report_to)
            rows = run_results(out)
        else:
            display = SweepProgress(console, spec)
            with cluster.session(), display.progress:
                rows = run_sweep(spec, out, placement, progress=display,
                                 before_trials=lambda plan: print_references(
                                     console, make_references(plan, placement)))
    except TrialsInterrupted:
        console.print(f"[bold yellow]interrupted:[/] running trials cancelled; results so far "
                      f"in {out / 'results.parquet'}")
        raise typer.Exit(code=130) from None
    except (SpecError, RefusedOutput, RayAddressError, RuntimeError, FileNotFoundError,
            ValueError) as err:  # ValueError: a dataset edited or split the old way
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(code=2) from err
    except OSError as err:  # a full disk: what finished is kept, and a re-run keeps it
        kept = (f"; the finished trials' adapters are in {out}/<trial id>/, and a re-run "
                "there keeps them") if err.errno in FULL else ""
        console.print(f"[bold red]error:[/] {err}{kept}")
        raise typer.Exit(code=1) from err
    console.print(results_table(spec, rows, out))
    if (why := why_unranked(rows, spec.metric)) is not None:  # ran, but chose nothing
        console.print(f"[bold red]error:[/] sweep {spec.name}: {why}")
        raise typer.Exit(code=1)


def print_references(console: Console, made: list[dict[str, Any]]) -> None:
    """One line per reference the sweep's trials train against, made before any of them."""
    for ref in made:
        how = "were cached" if ref["cached"] else "computed"
        console.print(f"reference log-probs {how} in {ref['seconds']:.1f} s: {ref['path']}")


def run_results(out: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(out / "results.parquet").to_pylist()


def results_table(spec: SweepSpec, rows: list[dict[str, Any]], out: Path) -> Table:
    """One line per trial: status, the spec's metric, accuracy, speed, memory, note."""
    table = Table(title=f"sweep {spec.name}: {out / 'results.parquet'}")
    for col in ("trial", "status", spec.metric, "accuracy", "tokens/s", "peak GB", "note"):
        table.add_column(col)
    for r in rows:
        metric = metric_value(r, spec.metric)
        table.add_row(r["trial_id"], r["status"], f"{metric:.4f}" if metric is not None else "-",
                      f"{r['best_val_accuracy']:.3f}" if r.get("best_val_accuracy") else "-",
                      f"{r['tokens_per_sec']:,.0f}" if r.get("tokens_per_sec") else "-",
                      f"{r['peak_memory_gb']:.2f}" if r.get("peak_memory_gb") else "-",
                      trial_note(r))
    return table


def trial_note(row: dict[str, Any], width: int = 100) -> str:
    """A row's note: ``cached``, or its reason's first line, cut to ``width``. A refused
    point's reason opens with its id and params' JSON (tasks/sweep/sweep_spec.py, ``plan``),
    which the row's own columns hold: the note starts at the rule it broke."""
    if row.get("skipped"):
        return "cached"
    reason = str(row.get("reason") or "")
    head = f"trial {row.get('trial_id')} "
    if reason.startswith(head + "{"):
        try:
            _, end = json.JSONDecoder().raw_decode(reason, len(head))
            reason = reason[end:].removeprefix(": ")
        except ValueError:
            pass  # not the params after all: the reason whole
    line = next(iter(reason.strip().splitlines()), "")
    return line if len(line) <= width else line[:width - 1] + "…"


def memory_table(rows: list[dict[str, Any]], out: Path) -> Table:
    """The memory sweep's settings by peak memory, Pareto-optimal ones starred."""
    table = Table(title=f"memory sweep: {out / 'memory.md'}, {out / 'memory.png'}")
    for col in ("setting", "peak GB", "tokens/s", "step s", "pareto"):
        table.add_column(col)
    for r in sorted(rows, key=lambda r: r.get("peak_gb", float("inf"))):
        if "error" in r:
            table.add_row(r["setting"], "-", "-", "-", r["error"][:60])
        else:
            table.add_row(r["setting"], f"{r['peak_gb']:.3f}", f"{r['tokens_per_sec']:,.0f}",
                          f"{r['step_s']:.3f}", "★" if r["pareto"] else "")
    return table
