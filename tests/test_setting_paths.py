"""The path one setting takes from the spec to the trial: how many files carry it, and that
it is parsed once (issue 53). The construction and reference counts per trial are in
tests/test_trial_plan.py."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# From the spec to the trial: everything above the engine, and the engine's settings (the
# TrainConfig a trial receives). Past that the trial uses the value: the segmented backward
# reads segment_size, the reference pass reads its reference; that is not passing it on.
PATH = ("cli", "flows", "tasks", "engine/settings")
MOST = 8  # the acceptance line: at most 8 files from the spec to the trial


def carries(path: Path, name: str) -> bool:
    """Whether ``path``'s code (not its docstrings or comments) names ``name``: a variable,
    attribute, parameter, keyword or string key."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        named = (node.id if isinstance(node, ast.Name) else
                 node.attr if isinstance(node, ast.Attribute) else
                 node.arg if isinstance(node, ast.keyword | ast.arg) else
                 node.value if isinstance(node, ast.Constant) and id(node) not in docs
                 else None)
        if named == name:
            return True
    return False


def files_carrying(name: str) -> list[str]:
    return [str(p.relative_to(ROOT)) for folder in PATH
            for p in sorted((ROOT / folder).rglob("*.py")) if carries(p, name)]


@pytest.mark.unit
@pytest.mark.parametrize("name", ["segment_size", "reference", "scorers"])
def test_a_setting_passes_through_at_most_eight_files(name: str) -> None:
    """Issue 53: segment_size passed through 14 files and reference through 16, each
    re-reading it. Would catch: a new file that takes the value apart again on its way
    (a flag, a dict key, a keyword passed along) instead of the typed value carrying it."""
    files = files_carrying(name)
    assert files, f"{name}: carried by no file (the scan is broken)"
    assert len(files) <= MOST, f"{name} passes through {len(files)} files: {files}"


@pytest.mark.unit
def test_the_scan_sees_code_not_prose(tmp_path: Path) -> None:
    """The count above reads names in code; a docstring naming them is not a carrier."""
    prose = tmp_path / "prose.py"
    prose.write_text('"""The segment_size of a trial."""\n\ndef f():\n    """scorers"""\n')
    code = tmp_path / "code.py"
    code.write_text("def f(cfg):\n    return cfg.segment_size, {'scorers': 1}\n")
    assert not carries(prose, "segment_size") and not carries(prose, "scorers")
    assert carries(code, "segment_size") and carries(code, "scorers")


@pytest.mark.integration
def test_a_spec_s_scorers_are_parsed_once_from_spec_to_scores(
        tiny_model: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two scorers named in a spec are parsed when it is read, and never again: not by the
    settings' check, the cache key, the pre-flight on the data, nor the evaluation that
    scores (its settings pickled, as Ray sends them). Would catch: settings that hold the
    strings and parse them where used (four places before issue 53)."""
    from tasks.eval import scorers
    from tasks.eval.evaluate import evaluate_adapter
    from tasks.eval.generation_eval import check_scorers_on_data
    from tasks.prefect.pipeline_tasks import generation_key
    from tasks.sweep.spec_file import parse_spec

    parsed: list[Any] = []
    parse = scorers.parse_scorer

    def counted(text: Any) -> Any:
        parsed.append(text)
        return parse(text)

    monkeypatch.setattr(scorers, "parse_scorer", counted)
    spec = parse_spec({"name": "s", "model": str(tiny_model), "data": str(tiny_data),
                       "evaluation": {"scorers": ["exact", r"n=regex:(\d+)"], "prompts": 2,
                                      "max_tokens": 2}})
    assert parsed == ["exact", r"n=regex:(\d+)"]
    settings = pickle.loads(pickle.dumps(spec.evaluation))  # what a Ray task receives
    assert generation_key(settings)["scorers"] == ["exact", r"n=regex:(\d+)"]
    check_scorers_on_data(settings, str(tiny_model), str(tiny_data))
    result = evaluate_adapter(str(tiny_model), None, str(tiny_data), generation=settings)
    assert set(result.generations[0]["scores"]) == {"exact", "n"}
    assert "gen/valid/n" in result.metrics
    assert len(parsed) == 2  # read once, with the spec


class Untouchable(dict):
    """A spec's dict, read after the sweep was planned: any read fails, naming it."""

    def _read(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the spec's settings read after planning ({args!r})")

    __getitem__ = get = items = keys = values = __iter__ = __contains__ = __len__ = _read


@pytest.mark.unit
def test_once_planned_no_route_reads_the_spec_s_settings(tiny_model: Path, tiny_data: Path,
                                                         tmp_path: Path) -> None:
    """The file count above gives 4/8/3 on the tree before issue 53 too: its routes
    re-read the spec's dicts (params keyed by trial id, the cache key, the param/ columns and
    the log line made from them), which no name count sees. Here the sweep is planned, the
    spec's fixed, grid and space poisoned, and every trial's config, key, columns, the
    table, the rules and the references still come out, from the plan alone."""
    from tasks.nodes.placement import Placement
    from tasks.sweep.references import reference_needs
    from tasks.sweep.spec_file import parse_spec
    from tasks.sweep.sweep_plan import plan_sweep

    spec = parse_spec({"name": "s", "model": str(tiny_model), "data": str(tiny_data),
                       "fixed": {"loss": "dpo", "steps": 1, "segment_size": 2},
                       "grid": {"learning_rate": [1e-5, 2e-5]}})
    plan = plan_sweep(spec, tmp_path / "out", Placement())
    for name in ("fixed", "grid", "space"):
        object.__setattr__(spec, name, Untouchable())
    rows = plan.table([{"trial_id": p.id, "status": "completed"} for p in plan.todo], {}, [])
    assert [r["param/segment_size"] for r in rows] == [2, 2]
    assert len({plan.key_of(p.id, {}) for p in plan.todo}) == 2
    assert [p.config.segment_size for p in plan.todo] == [2, 2]
    assert plan.rules(2).max_concurrent == 2
    [(reference, _)] = reference_needs(plan)
    assert reference.model == str(tiny_model)
