"""No plain function takes more than 8 parameters: settings that travel together travel as
one value (issue 53)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "tasks", "flows", "cli", "benchmarks")


def where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


MAX_PARAMETERS = 8  # more: they travel together, so a settings value carries them (issue 53)
# A Prefect flow's or task's parameters are its run form in the UI, a deployment's
# parameters and what its cache key reads, one by one; a typer command's are its flags.
ONE_BY_ONE = ("flow", "task", "command")
MANY_PARAMETERS: dict[str, str] = {  # "path:function" -> why it keeps them
    "engine/model/attention.py:blockwise_attention": "a kernel: the tensors, the mask's "
    "shape and the block sizes, as mx.fast.scaled_dot_product_attention takes them",
}


def many_parameters(path: Path) -> list[str]:
    """``name (N)`` of each plain function in ``path`` taking over MAX_PARAMETERS."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        marks = {d.func if isinstance(d, ast.Call) else d for d in node.decorator_list}
        if any(getattr(m, "attr", getattr(m, "id", "")) in ONE_BY_ONE for m in marks):
            continue
        named = [a.arg for a in (*node.args.posonlyargs, *node.args.args,
                                 *node.args.kwonlyargs) if a.arg not in ("self", "cls")]
        if len(named) > MAX_PARAMETERS and f"{where(path)}:{node.name}" not in MANY_PARAMETERS:
            found.append(f"{node.name} ({len(named)})")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_takes_more_than_eight_parameters(package: str) -> None:
    """Issue 53: seven functions took 11-12 parameters (the flows' stages, run_trials,
    evaluate_adapter), each a copy of settings that travel together. A plain function
    over 8 takes a settings value instead (Cluster, Ranking, BoardOptions, TrialRules,
    ForwardOptions), or is listed with its reason."""
    found = [f"{where(p)}: {f}" for p in sorted((ROOT / package).rglob("*.py"))
             for f in many_parameters(p)]
    assert not found, f"over {MAX_PARAMETERS} parameters:\n" + "\n".join(found)


def test_the_parameter_count_sees_plain_functions_only(tmp_path: Path) -> None:
    """Would catch a count that misses methods' self, or exempts every decorated function."""
    path = tmp_path / "f.py"
    nine = ", ".join(f"a{i}" for i in range(9))
    path.write_text(f"@flow\ndef f({nine}): ...\n@app.command('x')\ndef g({nine}): ...\n"
                    f"@cache\ndef h({nine}): ...\nclass C:\n    def m(self, {nine[:-4]}): ...\n")
    assert [f.split(" ")[0] for f in many_parameters(path)] == ["h"]
