"""The ``pomona data tokenize|preprocess|stats`` commands: progress, tables, errors.

A user's mistake (a missing or unreadable file, a bad option, an --out that is not ours to
replace, too many bad rows) ends with exit status 2 and one line naming the file, row or
option, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.data.shards import split_problem
from tasks.data.data_check import CheckLimits
from tasks.data.dataset_dir import read_manifest
from tasks.data.preprocess import preprocess_dataset
from tasks.data.tokenize import TokenizeReport, rejects_paths, tokenize_dataset
from tasks.data.tokenize_options import TokenizeOptions

# OSError: unreadable or unwritable paths; ValueError: bad data or options (the data
# modules' own errors all derive from these two).
USER_ERRORS = (OSError, ValueError)


def _exit(console: Console, message: str) -> typer.Exit:
    """One line (a path or a raw row may hold newlines or rich markup), exit status 2."""
    line = " ".join(message.split())
    console.print(f"[bold red]error:[/] {escape(line)}")
    return typer.Exit(code=2)


def _warn_outliers(console: Console, report: TokenizeReport) -> None:
    o = report.outliers
    if not o.get("count"):
        return
    named = ", ".join(f"{r['id']!r} ({r['tokens']:,} tokens, {r['source']} line {r['line']})"
                      for r in o["rows"][:3])
    console.print(f"[yellow]warning:[/] {o['count']} pair(s) over {o['factor']}× the p99 "
                  f"length ({o['p99']:,} tokens): {escape(named)}. One long pair can exhaust "
                  "memory in training: lower --max-length or remove them")


def run_tokenize(console: Console, input: Path, model: str, out: Path,
                 options: TokenizeOptions, preprocess: bool) -> None:
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("tokenizing", total=None)

            def progress(rows: int, tokens: int) -> None:
                bar.update(task, description=f"tokenizing: {rows:,} rows read, "
                                             f"{tokens:,} tokens")

            report = tokenize_dataset(input, model, out, options, progress)
    except USER_ERRORS as err:
        raise _exit(console, str(err)) from err
    if report.cache_hit:
        console.print(f"cache hit: {escape(str(out))} already holds this input "
                      f"(fingerprint {report.fingerprint[:12]}); nothing to do")
    else:
        bad = sum(report.rejects.values())
        console.print(f"tokenized {report.rows:,} {_kind(out)} ({report.tokens:,} tokens) in "
                      f"{report.seconds:.1f} s, {report.tokens_per_sec:,.0f} tokens/s; "
                      f"{bad} rejected (see {escape(str(rejects_paths(out)[0]))})")
    _warn_outliers(console, report)
    _print_notes(console, report.notes)
    done = (read_manifest(out) or {}).get("preprocessed") and report.cache_hit
    if preprocess and not done and _kind(out) == "pairs":  # prompts have no pairs to share
        run_preprocess(console, out, None, None, None, shown=set(report.notes))
    run_stats(console, out)


def _kind(out: Path) -> str:
    """What the dataset at ``out`` holds: pairs, or prompts (GRPO's)."""
    return (read_manifest(out) or {}).get("kind", "pairs")


def run_preprocess(console: Console, path: Path, out: Path | None,
                   valid_fraction: float | None, test_fraction: float | None,
                   shown: set[str] | None = None) -> None:
    try:
        r = preprocess_dataset(path, out, valid_fraction, test_fraction)
    except USER_ERRORS as err:
        raise _exit(console, str(err)) from err
    console.print(f"preprocessed {r.rows:,} pairs: {r.duplicates_removed} duplicates removed, "
                  f"prefix share rate {r.prefix_share_rate:.1%}, sharing saves "
                  f"{r.tokens_saved:,} of {r.tokens_two_forward:,} tokens "
                  f"({r.saved_fraction:.1%})")
    _print_notes(console, [n for n in r.notes if n not in (shown or set())])


def _print_notes(console: Console, notes: list[str]) -> None:
    """An empty valid or test split, a cache rebuilt: one line each, never an error."""
    for note in dict.fromkeys(notes):
        console.print(f"[yellow]note:[/] {escape(note)}")


def run_stats(console: Console, path: Path) -> None:
    m = read_manifest(path)
    if m is None:
        raise _exit(console, f"{path}: not a complete Pomona dataset (no valid manifest.json)")
    try:
        table = _stats_table(path, m)
    except (KeyError, TypeError, ValueError) as err:  # a manifest edited by hand
        raise _exit(console, f"{path}/manifest.json: incomplete or malformed ({err!r}); "
                             "tokenize again to rewrite it") from err
    console.print(table)


def _stats_table(path: Path, m: dict) -> Table:
    table = Table(title=escape(f"dataset {path}"))
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = m["rows"]
    test = f"{rows['test']:,}" if "test" in rows else "none: tokenized before the test split"
    table.add_row("rows (train / valid / test)", f"{rows['total']:,} ({rows['train']:,} / "
                                                 f"{rows['valid']:,} / {test})")
    table.add_row("rows read", f"{rows.get('read', rows['total']):,}")
    table.add_row("split", "by prompt" if not split_problem(m) else
                  "by row: tokenize again (a prompt's pairs may straddle train and test)")
    for reason, n in sorted(m.get("rejects", {}).items(), key=lambda kv: -kv[1]):
        table.add_row(f"rejected: {reason}", f"{n:,}")
    for reason, n in sorted(m.get("truncation", {}).items()):
        table.add_row(reason.replace("_", " "), f"{n:,}")
    for k, s in m.get("token_lengths", {}).items():
        if s:
            table.add_row(f"{k} tokens p50 / p95 / max",
                          f"{s['p50']:.0f} / {s['p95']:.0f} / {s['max']}")
    if m.get("preprocessed"):
        table.add_row("duplicates removed", f"{m['duplicates_removed']:,}")
        table.add_row("prefix share rate", f"{m['prefix_share_rate']:.1%}")
        saved = m["tokens_saved"] / max(m["tokens_two_forward"], 1)
        table.add_row("tokens saved by sharing", f"{m['tokens_saved']:,} ({saved:.1%})")
    if (o := m.get("outliers") or {}).get("count"):
        table.add_row(f"pairs over {o['factor']}× p99 length", f"{o['count']:,}")
    return table


def run_check(console: Console, input: Path, model: str, options: TokenizeOptions,
              limits: CheckLimits, strict: bool) -> int:
    """``pomona data check``: tokenized into a scratch folder (the user's files untouched),
    the findings printed, each over its limit a warning; 1 where ``strict`` and any is."""
    import tempfile

    from tasks.data.data_check import check_dataset
    from tasks.data.preference_rows import raw_kind

    kind = raw_kind(input) if input.exists() else "pairs"
    if kind != "pairs":  # no pair to check
        what = ("prompt rows (a prompt and an answer, no pair)" if kind == "prompts" else
                "unpaired rows (a prompt, one completion and a label, no pair)")
        raise _exit(console, f"{input}: {what}: data check checks preference pairs")
    with tempfile.TemporaryDirectory(prefix="pomona-check-") as tmp:
        try:
            tokenize_dataset(input, model, Path(tmp) / "data", options)
            report = check_dataset(Path(tmp) / "data", input, limits)
        except (ValueError, OSError) as err:
            raise _exit(console, str(err)) from None
    rows = ", ".join(f"{k} {v}" for k, v in report.rows.items())
    table = Table(title=escape(f"data check: {input} (rows: {rows})"))
    for col in ("split", "check", "value", "limit", "rows"):
        table.add_column(col, overflow="fold")
    for f in report.findings:
        value = f"[yellow]{f.value:.3g}[/]" if f.over else f"{f.value:.3g}"
        table.add_row(f.split, f.check, value, f"{f.limit:g}", escape(", ".join(f.ids)))
    console.print(table)
    for f in report.over:
        console.print(f"[yellow]warning:[/] {escape(f.line())}")
    if strict and report.over:
        console.print(f"[red]error:[/] {len(report.over)} finding(s) over their limits "
                      "(--strict)")
        return 1
    return 0
