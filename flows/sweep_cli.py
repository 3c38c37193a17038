"""``pomona sweep SPEC``: connect to (or start) Ray, run the sweep, print the results."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tasks.sweep import run_sweep
from tasks.sweep_spec import SpecError, load_spec
from tasks.trials import Placement


def run_sweep_cli(console: Console, spec_path: Path, out: Path | None, address: str | None,
                  gpus: bool, resource: str | None) -> None:
    import ray

    try:
        spec = load_spec(spec_path)
    except (SpecError, FileNotFoundError) as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(code=2) from err
    out = out or Path("runs") / spec.name
    if address:
        ray.init(address=address, log_to_driver=False)
    else:  # a private local cluster; never join whatever else runs on this machine
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        rows = run_sweep(spec, out, Placement(gpus=int(gpus), resource=resource),
                         progress=console.print)
    except (SpecError, RuntimeError, FileNotFoundError) as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(code=2) from err
    finally:
        ray.shutdown()
    table = Table(title=f"sweep {spec.name}: {out / 'results.parquet'}")
    for col in ("trial", "status", spec.metric, "accuracy", "tokens/s", "note"):
        table.add_column(col)
    for r in rows:
        metric = r.get("best_val_loss") if spec.metric == "val/loss" else None
        table.add_row(r["trial_id"], r["status"], f"{metric:.4f}" if metric else "-",
                      f"{r['best_val_accuracy']:.3f}" if r.get("best_val_accuracy") else "-",
                      f"{r['tokens_per_sec']:,.0f}" if r.get("tokens_per_sec") else "-",
                      "cached" if r.get("skipped") else (r.get("reason") or "")[:60])
    console.print(table)
