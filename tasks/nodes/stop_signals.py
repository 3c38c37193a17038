"""How a long verb hears "stop": SIGINT and SIGTERM, both as KeyboardInterrupt.

Then a sweep cancels its running trials, writes results.parquet and exits 130, whichever
way it was asked. Two defaults got in the way (issue 36, item 17):

- a shell script that starts ``pomona sweep … &`` hands it SIGINT ignored (POSIX, for
  background jobs without job control), so its later ``kill -INT`` did nothing;
- ``ray.init`` sets SIGTERM to ``sys.exit`` in the driver, and the scheduler then waited
  for every running trial to end before the process could exit.

``hear_stop_signals`` runs at the CLI's start and again once Ray is up (it replaces
Ray's SIGTERM handler); only the main thread may set handlers, so elsewhere it does
nothing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


def hear_stop_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread from now on."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")
