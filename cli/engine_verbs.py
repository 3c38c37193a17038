"""``pomona train``, ``score`` and ``export``: the engine's verbs (engine/cli.py), their
flags rendered by typer from the declaration ``python -m engine`` renders with argparse, so
both take the same options and ``pomona train --help`` lists every TrainConfig field.

The command that parses a verb is built when the verb runs: its flags come from the
engine's dataclasses, whose modules import MLX, and ``pomona --help`` or ``pomona sweep``
should not wait for that. ``pomona --help`` lists each verb by the line below.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import typer
import typer.main
from typer.models import CommandInfo

from cli import shared_options
from cli.options import flag_params, signed

LISTED = {
    "train": "Train one adapter: `pomona train --model DIR --data PATH --out DIR` (--help: all).",
    "score": "Score pairs: `pomona score --model DIR [--adapter DIR] --data PATH --out "
             "FILE.jsonl`.",
    "export": "A GGUF for llama.cpp, Ollama, LM Studio: `pomona export RUN --gguf OUT.gguf`.",
}
HELP = {"help_option_names": ["-h", "--help"]}  # pomona's own, every verb's
# A verb that hands its arguments on unread (the engine's, built when it runs; bench's).
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
               "help_option_names": []}


REPORT_TO = inspect.Parameter("report_to", inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=shared_options.REPORT_TO)


def add_engine_verbs(app: typer.Typer) -> None:
    """Register each engine verb on ``app``: it hands its arguments to ``verb_command``."""
    for verb, listed in LISTED.items():
        app.command(verb, help=listed, context_settings=PASSTHROUGH,
                    add_help_option=False)(_handing_to(verb))


def _handing_to(verb: str) -> Any:
    def run(ctx: typer.Context) -> None:
        code = verb_command(verb).main(list(ctx.args), prog_name=ctx.command_path,
                                       standalone_mode=False)
        raise typer.Exit(code=code or 0)

    return run


@functools.cache
def verb_command(verb: str) -> Any:
    """The typer command that parses ``verb``'s flags and runs it (engine/cli.py)."""
    from engine.cli import VERBS

    flags, about = VERBS[verb]
    extra = [REPORT_TO] if verb == "train" else []  # pomona's own: the engine tracks nothing

    def run(**values: Any) -> None:
        from engine.cli import RUNNERS

        if names := values.pop("report_to", None):
            raise typer.Exit(code=train_tracked(values, names))
        raise typer.Exit(code=RUNNERS[verb](values))

    info = CommandInfo(verb, callback=signed(run, [*flag_params(flags()), *extra]), help=about,
                       context_settings=HELP)
    return typer.main.get_command_from_info(info, pretty_exceptions_short=True,
                                            rich_markup_mode=None)



def train_tracked(values: dict[str, Any], names: list[str]) -> int:
    """``train`` with its metrics, outcome and adapter sent to the trackers ``names``
    (tasks/track/train_run.py: the engine trains in a child process); its exit code."""
    from cli.terminal import fail
    from engine.cli import RUNNERS, replayable, train_config, train_flags
    from engine.host.flags import command_line
    from tasks.sweep.trial_plan import settings_of
    from tasks.track.report_to import ReportTo
    from tasks.track.sinks import tracker_problem
    from tasks.track.train_run import track_train

    try:
        report_to = ReportTo.parse(names, "--report-to")
        if report_to and not replayable(values.get("config")):  # read here, then by the engine
            raise ValueError(f"--config {values['config']}: with --report-to, a file that "
                             "can be read twice (not a pipe or /dev/stdin)")
        cfg = train_config(values)
        if problem := tracker_problem(report_to):
            raise ValueError(problem)
    except ValueError as err:
        raise fail(str(err)) from None
    if not report_to:  # --report-to none
        return RUNNERS["train"](values)
    return track_train(command_line(train_flags(), values), Path(cfg.out), report_to,
                       settings_of(cfg))
