"""Preference files → validated conversations, or rejects with a reason.

Reads JSONL, JSON (an array), Parquet or CSV files, or a directory of them, in the
layouts of datasets/README.md (pairs: explicit, conversational, implicit; prompts alone;
KTO's unpaired prompt/completion/label, text or messages), detected per file as
the layout most of its rows are valid in (``layout`` overrides). Every bad row becomes a
``Reject`` naming its file, line, reason and raw content, so a scheduled run never dies on
one row at 2 a.m. and no row disappears without a count. A file that cannot be read at all
raises ``UnreadableFile``: counting it as one bad row would drop all its rows unseen.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.data.row_fields import (
    BadRow,
    Messages,
    answer_field,
    check_prompt_turns,
    label_field,
    messages_field,
    prompt_only,
    row_id,
    system_field,
    text_field,
    unpaired_fields,
    utf8,
)

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
LAYOUTS = ("explicit", "conversational", "implicit", "prompts", "conversational-prompts",
           "unpaired", "conversational-unpaired")
# Rows of a prompt alone (and the answer a verifier reads): what GRPO samples from.
PROMPT_LAYOUTS = ("prompts", "conversational-prompts")
# A prompt, one completion and whether it is desirable (TRL's unpaired layout): KTO's own.
UNPAIRED_LAYOUTS = ("unpaired", "conversational-unpaired")


@dataclass(frozen=True)
class Conversation:
    """A valid row. prompt/chosen/rejected are text (str) or messages (list of dicts)."""

    id: str
    source: str
    line: int
    layout: str
    system: str | None
    prompt: str | Messages
    chosen: str | Messages  # a prompt row's answer ("" when it gave none); an unpaired
    rejected: str | Messages  # row's completion; "" in a prompt or unpaired row
    group: str = ""  # the split key: the row's ``group`` field, else its normalised prompt
    label: bool | None = None  # an unpaired row's: its completion desirable or not

    @property
    def is_prompt(self) -> bool:
        """A prompt row (GRPO's), not a pair."""
        return self.layout in PROMPT_LAYOUTS

    @property
    def kind(self) -> str:
        """The kind of dataset the row belongs in: pairs, prompts or unpaired."""
        return ("prompts" if self.is_prompt else "unpaired" if self.layout in UNPAIRED_LAYOUTS
                else "pairs")


@dataclass(frozen=True)
class Reject:
    """A row that cannot be used, and why (``reason`` is a short stable code)."""

    source: str
    line: int
    reason: str
    raw: Any

    def to_json(self) -> dict[str, Any]:
        raw = self.raw if isinstance(self.raw, (dict, list, str)) else repr(self.raw)
        return {"source": self.source, "line": self.line, "reason": self.reason, "raw": raw}


class UnreadableFile(ValueError):
    """A whole input file cannot be read (corrupt, truncated, not UTF-8, no permission)."""

    def __init__(self, path: Path, err: Exception) -> None:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        super().__init__(f"{path}: cannot read this file ({type(err).__name__}: {first}); "
                         "none of its rows can be counted, so the run stops. Fix or remove "
                         "the file and run again")


def list_files(path: Path) -> list[Path]:
    """``path`` itself, or every supported file below it (sorted, recursive)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input not found: {path}")
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise ValueError(f"{path}: unsupported file type; expected {', '.join(SUFFIXES)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not files:
        raise ValueError(f"{path}: no {', '.join(SUFFIXES)} files in the directory")
    return files


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UnreadableFile(path, err) from err
    data = data.removeprefix(b"\xef\xbb\xbf")  # a BOM (Windows editors) is not part of row 1
    for i, raw_line in enumerate(data.splitlines(), 1):
        if not raw_line.strip():
            continue
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError:
            yield i, raw_line.decode("utf-8", "replace"), "invalid_utf8"
            continue
        try:
            yield i, json.loads(text), None
        except (json.JSONDecodeError, RecursionError):  # deep nesting overflows the parser
            yield i, text, "malformed_json"


def _read_whole(path: Path) -> list[Any]:
    """Rows of a .json, .parquet or .csv file, which are read whole or not at all."""
    import pyarrow.parquet as pq

    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(path.read_bytes().decode("utf-8-sig"))
            return data if isinstance(data, list) else [data]
        table = pq.read_table(path) if suffix == ".parquet" else _read_csv(path)
    except Exception as err:  # json, UTF-8, OS and pyarrow's several error types
        raise UnreadableFile(path, err) from err
    return [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]


def _read_csv(path: Path) -> Any:
    """Every column as text (a response "42" must not become an int), an empty cell as absent."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    with pcsv.open_csv(path) as header:  # the column names, from the first block
        names = header.schema.names
    return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
        column_types={n: pa.string() for n in names}, strings_can_be_null=True,
        null_values=[""]))


def read_raw(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line, raw object, problem) for each row of one file; problem is a reason or None.

    Raises UnreadableFile when the file as a whole cannot be read.
    """
    if path.suffix.lower() == ".jsonl":
        yield from _read_jsonl(path)
        return
    for i, row in enumerate(_read_whole(path), 1):
        yield i, row, None


def detect_layout(row: Any) -> str | None:
    """explicit | conversational | implicit from one object's fields, or None."""
    if not isinstance(row, dict):
        return None
    if "prompt" in row:
        kind = "conversational" if isinstance(row["prompt"], list) else "explicit"
        if "completion" in row:  # KTO's unpaired rows (a label beside the completion)
            return "conversational-unpaired" if kind == "conversational" else "unpaired"
        if "chosen" not in row and "rejected" not in row:  # a prompt alone: GRPO's rows
            return "conversational-prompts" if kind == "conversational" else "prompts"
        return kind
    if "chosen" in row or "rejected" in row:
        return "implicit"
    return None


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (text, messages, token ids)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _implicit(row: dict, system: str | None
              ) -> tuple[str | Messages, str | Messages, str | Messages]:
    """Split chosen/rejected conversations at their longest common prefix."""
    if "prompt" in row:  # an explicit or conversational row, never an implicit one
        raise BadRow("unexpected_field:prompt")
    c, r = row.get("chosen"), row.get("rejected")
    if isinstance(c, list) and isinstance(r, list):
        c, r = messages_field(row, "chosen", 2), messages_field(row, "rejected", 2)
        n = common_prefix(c, r)
        if n == 0:
            raise BadRow("no_common_prompt")
        if n >= min(len(c), len(r)):
            raise BadRow("empty_response")
        if any(m["role"] != "assistant" for m in c[n:] + r[n:]):
            raise BadRow("response_not_assistant")
        check_prompt_turns(c[:n], system)
        return c[:n], c[n:], r[n:]
    c, r = text_field(row, "chosen"), text_field(row, "rejected")
    n = common_prefix(c, r)
    if n == 0:
        raise BadRow("no_common_prompt")
    if n >= min(len(c), len(r)):
        raise BadRow("empty_response")
    return c[:n], c[n:], r[n:]


def validate(row: Any, layout: str, source: str, line: int) -> Conversation:
    """Check ``row`` against ``layout``; raise BadRow(reason) when it cannot be used."""
    if not isinstance(row, dict):
        raise BadRow("not_an_object")
    rid, system, label = row_id(row), system_field(row), None
    if layout == "explicit":
        prompt = text_field(row, "prompt")
        chosen, rejected = text_field(row, "chosen"), text_field(row, "rejected")
    elif layout == "conversational":
        prompt = messages_field(row, "prompt")
        chosen, rejected = messages_field(row, "chosen"), messages_field(row, "rejected")
        if any(m["role"] != "assistant" for m in chosen + rejected):
            raise BadRow("response_not_assistant")
        if any(not m["content"].strip() for m in chosen + rejected):
            raise BadRow("empty_response")
        check_prompt_turns(prompt, system)
    elif layout == "implicit":
        prompt, chosen, rejected = _implicit(row, system)
    elif layout in PROMPT_LAYOUTS:
        prompt, chosen, rejected = prompt_only(row, layout, system), answer_field(row), ""
    elif layout in UNPAIRED_LAYOUTS:
        (prompt, chosen), rejected = unpaired_fields(row, layout, system), ""
        label = label_field(row)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if chosen == rejected and layout not in (*PROMPT_LAYOUTS, *UNPAIRED_LAYOUTS):
        raise BadRow("chosen_equals_rejected")
    return Conversation(rid, source, line, layout, system, prompt, chosen, rejected,
                        split_group(row, system, prompt), label)


def split_group(row: dict, system: str | None, prompt: str | Messages) -> str:
    """The key a row's split is drawn from, so a prompt's pairs never straddle train and
    test: its ``group`` field (a string or an integer), else a hash of its prompt with the
    system turn, normalised (NFC, runs of whitespace as one space). Implicit text rows,
    whose prompt is the common prefix of the two answers, may want ``group``."""
    if "group" in row and row["group"] is not None:
        value = row["group"]
        if isinstance(value, float) and value.is_integer():  # pandas' ints beside a NaN
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise BadRow("wrong_type:group")
        if not str(value).strip():
            raise BadRow("empty_field:group")
        return "g:" + utf8(str(value), "group")

    def norm(text: str) -> str:
        return " ".join(unicodedata.normalize("NFC", text).split())

    turns = [["system", norm(system)]] if system else []
    turns += ([["user", norm(prompt)]] if isinstance(prompt, str)
              else [[m["role"], norm(m["content"])] for m in prompt])
    body = json.dumps(turns, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return "p:" + hashlib.sha256(body).hexdigest()[:16]


def _attempt(raw: Any, layout: str, source: str, line: int) -> Conversation | BadRow:
    try:
        return validate(raw, layout, source, line)
    except BadRow as err:
        return err


def majority_layout(looks: list[str | None], valid: list[str]) -> str | None:
    """The layout most rows are valid in; when none is valid, the one most rows look like.

    One odd row (say, an implicit-looking first row) can no longer decide the whole file.
    Ties go to the layout seen first.
    """
    votes = Counter(valid) or Counter(x for x in looks if x is not None)
    return votes.most_common(1)[0][0] if votes else None


def _read_file(file: Path, layout: str | None) -> Iterator[tuple[Conversation | Reject, Any]]:
    """(Conversation or Reject, raw row) for each row of one file."""
    source, rows = str(file), list(read_raw(file))
    looks = [None if problem else detect_layout(raw) for _, raw, problem in rows]
    tried = {} if layout else {i: _attempt(raw, looks[i], source, line)
                               for i, (line, raw, _) in enumerate(rows) if looks[i]}
    file_layout = layout or majority_layout(
        looks, [looks[i] for i, t in tried.items() if isinstance(t, Conversation)])
    for i in range(len(rows)):
        # Release each row as it goes: a whole file's rows held to the end slowed every
        # garbage-collector pass (~10 % of a tokenize run).
        (line, raw, problem), rows[i], own = rows[i], None, tried.pop(i, None)
        if problem is not None or file_layout is None:
            yield Reject(source, line, problem or "unknown_layout", raw), raw
            continue
        if looks[i] != file_layout and isinstance(own, Conversation):
            # a good row of another layout; a broken one gets its own defect below
            yield Reject(source, line, f"layout_mismatch:{looks[i]}", raw), raw
            continue
        result = own if looks[i] == file_layout and own is not None else _attempt(
            raw, file_layout, source, line)
        yield (result if isinstance(result, Conversation)
               else Reject(source, line, str(result), raw)), raw


def _content_key(c: Conversation) -> int:
    """A hash of the pair (in-process only): cheap, and holds none of the row's text."""
    def flat(x: str | Messages) -> str | tuple:
        return x if isinstance(x, str) else tuple((m["role"], m["content"]) for m in x)

    return hash((c.system, flat(c.prompt), flat(c.chosen), flat(c.rejected), c.label))


def read_conversations(path: Path, layout: str | None = None
                       ) -> Iterator[Conversation | Reject]:
    """Every row of every file under ``path``, as a Conversation or a Reject.

    A file's rows are held in memory while its layout is decided. An ``id`` given to two
    different pairs rejects the later one (``duplicate_id``; ``7`` and ``"7"`` are one id):
    the split and every score are keyed by it. The same pair twice is left to preprocess.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"--layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    seen: dict[str, int] = {}  # id given in the row → content key of its first pair
    for file in list_files(path):
        for item, raw in _read_file(file, layout):
            if isinstance(item, Conversation) and "id" in raw:
                key = _content_key(item)
                if seen.setdefault(item.id, key) != key:
                    item = Reject(item.source, item.line, "duplicate_id", raw)
            yield item


def raw_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The valid rows of raw preference data, as the decoded rows scorers read (id, prompt,
    chosen, rejected as text), one at a time; a bad row is tokenize's to count."""
    def text(part: Any) -> str:
        return part if isinstance(part, str) else "\n".join(m["content"] for m in part)

    for file in list_files(path):
        for line, raw, problem in read_raw(file):
            layout = None if problem else detect_layout(raw)
            try:
                row = validate(raw, layout, str(file), line) if layout else None
            except BadRow:
                continue
            if row is not None:
                yield {"id": row.id, "prompt": text(row.prompt), "chosen": text(row.chosen),
                       "rejected": text(row.rejected)}


def raw_kind(raw: str | Path) -> str:
    """The kind of rows raw data holds, by its first object as tokenize reads it
    (``detect_layout``): pairs, prompts (a prompt and an answer) or unpaired (KTO's)."""
    for file in list_files(Path(raw)):
        for _, row, problem in read_raw(file):
            if not problem:
                layout = detect_layout(row)
                return ("prompts" if layout in PROMPT_LAYOUTS else "unpaired"
                        if layout in UNPAIRED_LAYOUTS else "pairs")
    return "pairs"


def holds_prompt_rows(raw: str | Path) -> bool:
    """Whether raw data's first object is a prompt row (a prompt and an answer, no pair)."""
    return raw_kind(raw) == "prompts"
