"""Pomona's own warnings on the Prefect run's log: a tracker that is down
(tasks/track/tracker.py logs to ``pomona.track``) or a pack probe that failed
(tasks/sweep/pack_sizes.py, ``pomona.sweep``) is one line in the UI, on the flow or task
run it happened in, and on the console through Prefect's handler, once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger

SHOWN = ("pomona.track", "pomona.sweep")


class _ToRunLog(logging.Handler):
    """Each record handed to the run's logger (any thread: it carries the run's id)."""

    def __init__(self, run_logger: logging.LoggerAdapter, level: int) -> None:
        super().__init__(level)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        self.run_logger.log(record.levelno, "%s", record.getMessage())


@contextmanager
def in_run_log(level: int = logging.WARNING) -> Iterator[None]:
    """While the block runs, ``SHOWN`` loggers' records at ``level`` and above go to the
    current flow or task run's log."""
    handler = _ToRunLog(get_run_logger(), level)
    loggers = [logging.getLogger(name) for name in SHOWN]
    before = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False  # the run's logger prints it: once on the console too
    try:
        yield
    finally:
        for lg, propagate in zip(loggers, before, strict=True):
            lg.removeHandler(handler)
            lg.propagate = propagate
