"""The demo's printed tables, from the files its pipeline writes (no model, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_the_real_demo_shows_the_question_and_both_answers(tmp_path: Path) -> None:
    """The real demo's table: a chat-templated prompt shows its question (not the role
    markers or the trailing "Answer:"), responses their first line without special
    tokens, and the base model's and the best adapter's answers in the same row."""
    import json

    from rich.console import Console

    from cli.demo import generations_table

    prompt = ("<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nReverse the "
              "letters of this word: cbrio\nAnswer:<|im_end|>\n<|im_start|>assistant\n")
    for name, said, right in (("base", "Cabrio\nmore text", 0.0), ("best", "oirbc", 1.0)):
        (tmp_path / name).mkdir()
        row = {"id": "r1", "prompt": prompt, "chosen": " oirbc<|im_end|>\n",
               "rejected": " oirbm<|im_end|>\n", "generated": said,
               "scores": {"reverse": right}}
        (tmp_path / name / "generations.jsonl").write_text(json.dumps(row) + "\n")
    console = Console(width=200, record=True)
    console.print(generations_table(tmp_path / "base", tmp_path / "best"))
    row = next(x for x in console.export_text().splitlines() if "cbrio" in x)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells == ["Reverse the letters of this word: cbrio", "oirbc", "✗ Cabrio", "✓ oirbc"]


def test_the_table_shows_first_the_answers_the_adapter_fixed(tmp_path: Path) -> None:
    """Issue 54, item 6: the demo ends on samples where the base is wrong and the best
    adapter right, not on the first prompts whatever they show."""
    import json

    from rich.console import Console

    from cli.demo import generations_table

    cases = {"r1": ("odd", 0.0, "odd", 0.0), "r2": ("x", 0.0, "even", 1.0),
             "r3": ("odd", 1.0, "odd", 1.0), "r4": ("y", 0.0, "odd", 1.0)}
    for who in ("base", "best"):
        (tmp_path / who).mkdir()
        rows = [{"id": key, "prompt": f"Even or odd? {1000 + i}\nAnswer:", "chosen": " odd",
                 "rejected": " even",
                 "generated": said[0 if who == "base" else 2],
                 "scores": {"parity": said[1 if who == "base" else 3]}}
                for i, (key, said) in enumerate(cases.items())]
        (tmp_path / who / "generations.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    console = Console(width=200, record=True)
    console.print(generations_table(tmp_path / "base", tmp_path / "best", count=3))
    shown = [x for x in console.export_text().splitlines() if "Even or odd?" in x]
    numbers = [next(w for w in row.split() if w.isdigit()) for row in shown]
    assert numbers == ["1001", "1003", "1000"], shown  # the two fixed first, then the rest
