"""Synthetic preference tasks: learnable data that needs no download.

Each task has a deterministic correct answer (``chosen``) and a plausible near-miss
(``rejected``): one value swapped for a wrong one, one dropped, one duplicated, or two
neighbours transposed. A model that learns the task prefers chosen, so held-out preference
accuracy rising above 50% proves a pipeline really trains. ``sort`` is the default: most
of its near-misses break ascending order or repeat a value, which even a tiny model picks
up in a few hundred steps (measured: validation accuracy 0.51 → 0.79 in 300 ORPO steps,
90 s on 2 CPU cores); ``add`` and ``reverse`` need real arithmetic or copying. ``parity``
(is a four-digit number, written digit by digit, even or odd: a one-word answer read off its
last digit) is the one whose greedy answers a tiny model gets right within a demo (0.00 →
1.00 of 207 test prompts in 200 steps, README); ``max`` (the larger of two numbers) needs copying a
number out of the prompt, which the tiny model had not learned in 300 steps. Prompts
vary in length: up to ``max_shots`` worked examples precede the query (long prompts are
where prefix sharing pays).

    pomona data synth --task sort --n 500 --seed 0 --out data.jsonl --layout explicit
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where rows are drawn: `pomona --help` loads no numpy
    import numpy as np

TASKS = ("sort", "reverse", "add", "add-small", "max", "parity", "mixed")
LAYOUTS = ("explicit", "conversational", "implicit", "prompts", "conversational-prompts")
# A prompt row is its pair's prompt in this pair layout, the chosen response its answer.
PAIR_LAYOUT_OF = {"prompts": "explicit", "conversational-prompts": "conversational"}
NEAR_MISSES = ("substitute", "drop", "duplicate", "transpose")

SYSTEM_PROMPT = "You are a careful assistant. Answer with the result only."
# Anthropic-HH turn markers, used by the implicit layout.
HUMAN, ASSISTANT = "\n\nHuman: ", "\n\nAssistant: "

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_INSTRUCTIONS = {
    "sort": ("Sort these numbers in ascending order:", "Put the numbers in increasing order:"),
    "reverse": ("Reverse the letters of this word:", "Write this word backwards:"),
    "add": ("Add the two numbers:", "What is the sum?"),
    "add-small": ("Add the two numbers. Reply with the sum only:",
                  "What is the sum? Give just the number:"),
    "max": ("Which number is larger?", "Give the larger of the two numbers:"),
    "parity": ("Is this number even or odd?", "Even or odd?"),
}


@dataclass(frozen=True)
class Example:
    """One solved instance of a task: the query text and its tokens-as-words answer."""

    query: str
    answer: list[str]
    pool: list[str]  # values a wrong answer may draw from (plausible, not in the answer)


@dataclass(frozen=True)
class SynthRow:
    """One preference pair before it is laid out in a file layout."""

    id: str
    task: str
    instruction: str
    shots: list[Example]
    query: Example
    chosen: str
    rejected: str
    near_miss: str


def _sort_example(rng: np.random.Generator) -> Example:
    n = int(rng.integers(2, 13))
    values = [int(v) for v in rng.choice(100, size=n, replace=False)]
    pool = [str(v) for v in range(100) if v not in values]
    return Example(" ".join(map(str, values)), [str(v) for v in sorted(values)], pool)


def _reverse_example(rng: np.random.Generator) -> Example:
    n = int(rng.integers(3, 13))
    word = [_LETTERS[int(i)] for i in rng.integers(0, 26, size=n)]
    pool = [c for c in _LETTERS if c not in word] or list(_LETTERS)
    return Example("".join(word), word[::-1], pool)


def _add_example(rng: np.random.Generator) -> Example:
    a, b = (int(v) for v in rng.integers(0, 1000, size=2))
    total = str(a + b)
    return Example(f"{a} + {b}", list(total), [d for d in "0123456789"])


def _add_small_example(rng: np.random.Generator) -> Example:
    a, b = (int(v) for v in rng.integers(0, SMALL + 1, size=2))
    return Example(f"{a} + {b}", list(str(a + b)), [d for d in "0123456789"])


def _max_example(rng: np.random.Generator) -> Example:
    """Two distinct two-digit numbers (neither a prefix of the other, as a near miss must
    not be); the near miss is the smaller one (the pool)."""
    a, b = (int(v) + 10 for v in rng.choice(90, size=2, replace=False))
    return Example(f"{a} {b}", [str(max(a, b))], [str(min(a, b))])


def _parity_example(rng: np.random.Generator) -> Example:
    """A four-digit number written digit by digit ("8 3 1 9": each digit its own token, so
    the answer is a rule over 10 last tokens, not 82 two-digit ones to memorise); the
    answer is one word, the near miss the other."""
    n = int(rng.integers(1000, 10000))
    answer, other = ("even", "odd") if n % 2 == 0 else ("odd", "even")
    return Example(" ".join(str(n)), [answer], [other])


SMALL = 40  # add-small: operands 0..40, sums SmolLM2-135M gets right about half the time
_MAKERS: dict[str, Callable[[np.random.Generator], Example]] = {
    "sort": _sort_example,
    "reverse": _reverse_example,
    "add": _add_example,
    "add-small": _add_small_example,
    "max": _max_example,
    "parity": _parity_example,
}
_JOINERS = {"sort": " ", "reverse": "", "add": "", "add-small": "", "max": "", "parity": ""}


def near_miss(answer: list[str], pool: list[str], kind: str, rng: np.random.Generator) -> list[str]:
    """Corrupt ``answer`` by one edit of ``kind``; the result always differs from ``answer``."""
    out = list(answer)
    i = int(rng.integers(0, len(out)))
    if kind == "substitute":
        wrong = [p for p in pool if p != out[i]]
        out[i] = wrong[int(rng.integers(0, len(wrong)))]
    elif kind == "drop" and len(out) > 1:
        del out[i]
    elif kind == "transpose" and len(out) > 1 and len(set(out)) > 1:
        j = i + 1 if i + 1 < len(out) else i - 1
        while out[i] == out[j]:  # transposing equal neighbours changes nothing
            i = int(rng.integers(0, len(out) - 1))
            j = i + 1
        out[i], out[j] = out[j], out[i]
    else:  # duplicate (and the fallback when an edit cannot apply)
        out.insert(i, out[i])
    return out


def make_row(
    task: str, index: int, seed: int, rng: np.random.Generator, max_shots: int
) -> SynthRow:
    """Draw one preference pair for ``task`` ("mixed" picks a task per row)."""
    if task == "mixed":
        task = ("sort", "reverse", "add")[int(rng.integers(0, 3))]
    make, join = _MAKERS[task], _JOINERS[task]
    instruction = _INSTRUCTIONS[task][int(rng.integers(0, 2))]
    # Geometric-ish shot count: most prompts short, some long.
    shots = [make(rng) for _ in range(min(int(rng.geometric(0.35)) - 1, max_shots))]
    query = make(rng)
    chosen = join.join(query.answer)
    while True:  # neither response may be a prefix of the other, or an implicit-prompt
        # split (longest common prefix) would leave one response empty
        kind = NEAR_MISSES[int(rng.integers(0, len(NEAR_MISSES)))]
        rejected = join.join(near_miss(query.answer, query.pool, kind, rng))
        if not (chosen.startswith(rejected) or rejected.startswith(chosen)):
            break
    return SynthRow(
        id=f"synth-{task}-s{seed}-{index:06d}",
        task=task,
        instruction=instruction,
        shots=shots,
        query=query,
        chosen=chosen,
        rejected=rejected,
        near_miss=kind,
    )


def _shot_text(row: SynthRow, example: Example) -> str:
    return f"{row.instruction} {example.query}"


def _answer_text(row: SynthRow, example: Example) -> str:
    return _JOINERS[row.task].join(example.answer)


def explicit_prompt(row: SynthRow) -> str:
    """The prompt as one string: worked examples, then the query."""
    lines = [f"{_shot_text(row, s)}\nAnswer: {_answer_text(row, s)}" for s in row.shots]
    lines.append(f"{_shot_text(row, row.query)}\nAnswer:")
    return "\n\n".join(lines)


def layout_row(row: SynthRow, layout: str, with_system: bool) -> dict:
    """Render ``row`` in one of the file layouts of datasets/README.md: a pair's three,
    or a prompt row (GRPO's: the pair's prompt, its chosen response as the answer)."""
    if layout in ("prompts", "conversational-prompts"):
        pair = layout_row(row, PAIR_LAYOUT_OF[layout], with_system)
        return {**{k: v for k, v in pair.items() if k not in ("chosen", "rejected")},
                "answer": row.chosen}
    if layout == "explicit":
        out = {"id": row.id, "prompt": explicit_prompt(row), "chosen": " " + row.chosen,
               "rejected": " " + row.rejected}
        return {**out, "system": SYSTEM_PROMPT} if with_system else out
    if layout == "conversational":
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if with_system else []
        for shot in row.shots:  # few-shot examples become earlier turns
            messages.append({"role": "user", "content": _shot_text(row, shot)})
            messages.append({"role": "assistant", "content": _answer_text(row, shot)})
        messages.append({"role": "user", "content": _shot_text(row, row.query)})
        return {
            "id": row.id,
            "prompt": messages,
            "chosen": [{"role": "assistant", "content": row.chosen}],
            "rejected": [{"role": "assistant", "content": row.rejected}],
        }
    if layout == "implicit":
        turns = "".join(
            f"{HUMAN}{_shot_text(row, s)}{ASSISTANT}{_answer_text(row, s)}" for s in row.shots
        )
        prefix = f"{turns}{HUMAN}{_shot_text(row, row.query)}{ASSISTANT}"
        out = {"id": row.id, "chosen": prefix + row.chosen, "rejected": prefix + row.rejected}
        return {**out, "system": SYSTEM_PROMPT} if with_system else out
    raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def synth_rows(
    task: str = "sort",
    n: int = 500,
    seed: int = 0,
    layout: str = "explicit",
    max_shots: int = 8,
    system_fraction: float = 0.25,
    ids: bool = True,
    distinct: bool = False,
) -> Iterator[dict]:
    """Yield ``n`` preference rows of ``task`` in ``layout``; same arguments, same rows.

    ``ids=False`` leaves the optional ``id`` out, as in most public preference sets;
    ``distinct`` draws again where a query repeats an earlier one (held-out rows then ask
    what no training row asked).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    import numpy as np

    rng = np.random.default_rng(seed)
    seen: set[tuple[str, str]] = set()
    for i in range(n):
        row = make_row(task, i, seed, rng, max_shots)
        for _ in range(1000 if distinct else 0):
            if (row.task, row.query.query) not in seen:
                break
            row = make_row(task, i, seed, rng, max_shots)
        else:
            if distinct:
                raise ValueError(f"{task}: fewer than {n} distinct queries; ask for fewer rows")
        seen.add((row.task, row.query.query))
        out = layout_row(row, layout, with_system=bool(rng.random() < system_fraction))
        if not ids:
            del out["id"]
        yield out


# Any layout's fields (a prompt row's answer too).
ROW_FIELDS = frozenset({"id", "prompt", "chosen", "rejected", "system", "split", "answer"})


def _read_rows(path: Path) -> list:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    return json.loads(text) if path.suffix.lower() == ".json" else [
        json.loads(line) for line in text.splitlines()]


def is_synth_file(path: Path) -> bool:
    """Whether ``path`` holds rows this module wrote (its mark, the only file ``write_rows``
    replaces: engine/host/outputs.py): every row has synth's fields alone and one of its tasks'
    instructions. A user's own preference data holds neither."""
    phrases = [p for pair in _INSTRUCTIONS.values() for p in pair]

    def ours(row: object) -> bool:
        return (isinstance(row, dict) and {k for k, v in row.items() if v is not None}
                <= ROW_FIELDS and any(p in json.dumps(row) for p in phrases))

    try:
        rows = _read_rows(Path(path))
        return isinstance(rows, list) and bool(rows) and all(map(ours, rows))
    except Exception:  # unreadable, not JSON, not Parquet: not ours
        return False


def write_rows(rows: list[dict], out: Path) -> Path:
    """Write rows as JSONL (``.jsonl``), a JSON array (``.json``) or Parquet (``.parquet``),
    replacing only an earlier synthetic file (``is_synth_file``)."""
    from engine.host.atomic import write_atomic
    from engine.host.outputs import check_file

    out = Path(out)
    check_file(out, is_synth_file, "a synthetic data file")
    suffix = out.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{out}: unsupported extension {suffix!r}; use .jsonl, .json or .parquet")
    return write_atomic(out, lambda tmp: _write_as(rows, tmp, suffix))


def _write_as(rows: list[dict], tmp: Path, suffix: str) -> None:
    if suffix == ".jsonl":
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    elif suffix == ".json":
        tmp.write_text(json.dumps(rows, ensure_ascii=False, indent=1) + "\n")
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(dict.fromkeys(k for r in rows for k in r))  # optional fields too
        pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in keys}), tmp)


def verify(task: str, completion: str, chosen: str) -> float:
    """1.0 when ``completion`` is a right answer to a ``task`` row whose right answer is
    ``chosen``, in any of the ways it may rightly be written, and nothing else: a number
    with or without digit-group commas or a closing period (add, max); the sorted numbers
    separated by spaces or commas, bracketed or not (sort); the word in any case (parity);
    the reversed letters in any case, spaced or quoted (reverse). An answer wrapped in other
    words scores 0: the prompt asks for the result only."""
    if task not in _MAKERS:
        raise ValueError(f"task {task!r} has no verifier; expected one of {', '.join(_MAKERS)}")
    text = completion.strip().rstrip(".").strip()
    if task in ("add", "add-small", "max"):
        digits = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
        return float(bool(re.fullmatch(r"-?\d+", digits)) and int(digits) == int(chosen))
    if task == "sort":
        inner = text[1:-1] if text[:1] + text[-1:] in ("[]", "()") else text
        parts = [p for p in re.split(r"[\s,]+", inner) if p]
        return float(all(re.fullmatch(r"-?\d+", p) for p in parts) and
                     [int(p) for p in parts] == [int(v) for v in chosen.split()])
    if task == "parity":
        return float(text.casefold() == chosen.strip().casefold())
    letters = re.sub(r"[\s'\"`-]", "", text).casefold()
    return float(letters == chosen.strip().casefold())


def row_task(row_id: str) -> str | None:
    """The task of a row this module made, read from its id (``synth-<task>-s…``)."""
    match = re.fullmatch(r"synth-(.+)-s\d+-\d+", row_id or "")
    return match.group(1) if match and match.group(1) in _MAKERS else None
