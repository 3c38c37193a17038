"""Names that mean one thing (issue 71): no two modules share a file name, and no class is
named as another file's module unless it is that module's concept, listed with why. Before
this, ``engine/train/ledger.py`` (a run's books) sat beside ``tasks/track/ledger.py`` (what
trackers were sent), and ``Ranking`` the board's class beside ``engine/settings/ranking.py``,
the better rule."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "tasks", "flows", "cli", "benchmarks")
SPECIAL = {"__init__", "__main__"}
# "Class" -> why its name may be another file's module: the same concept on another floor,
# or a name a saved file spells.
SAME_CONCEPT = {
    "OnlinePairs": "the settings (engine/losses/sampled.py) of what engine/train/online_pairs.py "
                   "trains",
    "Paired": "the paired test's result (tasks/eval/intervals.py) that tasks/eval/paired.py runs",
    "StepTimes": "mlx-lm-lora's step figures, read as benchmarks/step_times.py reads Pomona's",
    "Run": "a training run's state (engine/train/run_parts.py); tasks/sweep/run.py runs a sweep, "
           "the verb's module",
    "Base": "the base-model reference, whose dotted name engine/settings/config.py writes into "
            "saved configs; engine/losses/base.py is the losses' protocol",
}


def modules(root: Path = ROOT) -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))
            if p.stem not in SPECIAL]


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def collisions(root: Path = ROOT) -> list[str]:
    """A file name twice; a public class named as another file's module."""
    files = modules(root)
    twice = [f"{name}.py twice" for name, n in Counter(p.stem for p in files).items() if n > 1]
    by_stem = {p.stem: p for p in files}
    named = []
    for path in files:
        for node in ast.parse(path.read_text()).body:
            other = by_stem.get(snake(node.name)) if isinstance(node, ast.ClassDef) else None
            if other is not None and other != path and node.name not in SAME_CONCEPT:
                named.append(f"{node.name} ({path.relative_to(root)}) vs "
                             f"{other.relative_to(root)}")
    return twice + named


@pytest.mark.unit
def test_no_name_means_two_things() -> None:
    assert not collisions(), collisions()


@pytest.mark.unit
def test_the_detector_sees_both_kinds(tmp_path: Path) -> None:
    """The two collisions issue 71 found, rebuilt: both are named."""
    for rel, text in [("engine/train/ledger.py", ""), ("tasks/track/ledger.py", ""),
                      ("engine/settings/ranking.py", ""),
                      ("tasks/board/board_settings.py", "class Ranking:\n    pass\n")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = collisions(tmp_path)
    assert found == ["ledger.py twice", "Ranking (tasks/board/board_settings.py) vs "
                     "engine/settings/ranking.py"], found
