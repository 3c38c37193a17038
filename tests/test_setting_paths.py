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
