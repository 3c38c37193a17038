"""Preference files → validated conversations, or rejects with a reason. Never raises on data.

Reads JSONL, JSON (an array), Parquet or CSV files, or a directory of them, in the three
layouts of datasets/README.md (explicit, conversational, implicit), detected per file from
its first object (``layout`` overrides). Every bad row becomes a ``Reject`` naming its file,
line, reason and raw content, so a scheduled run never dies on one row at 2 a.m. and no row
disappears without a count.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Conversation:
    """A valid row. prompt/chosen/rejected are text (str) or messages (list of dicts)."""

    id: str
    source: str
    line: int
    layout: str
    system: str | None
    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages


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


class BadRow(ValueError):
    """Raised inside validation; carries the reason code."""


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


def read_raw(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line, raw object, problem) for each row of one file; problem is a reason or None."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for i, raw_line in enumerate(path.read_bytes().splitlines(), 1):
            if not raw_line.strip():
                continue
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError:
                yield i, raw_line.decode("utf-8", "replace"), "invalid_utf8"
                continue
            try:
                yield i, json.loads(text), None
            except json.JSONDecodeError:
                yield i, text, "malformed_json"
    elif suffix == ".json":
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            yield 0, f"{type(err).__name__}: {err}", "malformed_json_file"
            return
        rows = data if isinstance(data, list) else [data]
        for i, row in enumerate(rows, 1):
            yield i, row, None
    else:
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path) if suffix == ".parquet" else pcsv.read_csv(
                path, convert_options=pcsv.ConvertOptions(strings_can_be_null=False))
        except Exception as err:  # pyarrow raises several types for a corrupt file
            yield 0, f"{type(err).__name__}: {err}", f"unreadable_{suffix[1:]}"
            return
        for i, row in enumerate(table.to_pylist(), 1):
            yield i, {k: v for k, v in row.items() if v is not None}, None


def detect_layout(row: Any) -> str | None:
    """explicit | conversational | implicit from one object's fields, or None."""
    if not isinstance(row, dict):
        return None
    if "prompt" in row:
        return "conversational" if isinstance(row["prompt"], list) else "explicit"
    if "chosen" in row or "rejected" in row:
        return "implicit"
    return None


def _text(row: dict, name: str) -> str:
    if name not in row:
        raise BadRow(f"missing_field:{name}")
    value = row[name]
    if not isinstance(value, str):
        raise BadRow(f"wrong_type:{name}")
    if not value.strip():
        raise BadRow(f"empty_field:{name}")
    return value


def _messages(row: dict, name: str, min_items: int = 1) -> Messages:
    if name not in row:
        raise BadRow(f"missing_field:{name}")
    value = row[name]
    if not isinstance(value, list) or len(value) < min_items:
        raise BadRow(f"wrong_type:{name}" if not isinstance(value, list) else f"empty_field:{name}")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise BadRow(f"wrong_type:{name}")
        if m.get("role") not in ROLES:
            raise BadRow("unknown_role")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (text, messages, token ids)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def content_id(row: dict) -> str:
    """A stable id from the row's content (for rows without one)."""
    body = json.dumps({k: v for k, v in row.items() if k != "id"}, sort_keys=True,
                      ensure_ascii=False)
    return "h-" + hashlib.sha256(body.encode()).hexdigest()[:16]


def _row_id(row: dict) -> str:
    if "id" not in row:
        return content_id(row)
    if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)):
        raise BadRow("wrong_type:id")
    if not str(row["id"]).strip():
        raise BadRow("empty_field:id")
    return str(row["id"])


def _system(row: dict) -> str | None:
    if "system" not in row or row["system"] is None:
        return None
    if not isinstance(row["system"], str):
        raise BadRow("wrong_type:system")
    return row["system"] or None


def _implicit(row: dict) -> tuple[str | Messages, str | Messages, str | Messages]:
    """Split chosen/rejected conversations at their longest common prefix."""
    c, r = row.get("chosen"), row.get("rejected")
    if isinstance(c, list) and isinstance(r, list):
        c, r = _messages(row, "chosen", 2), _messages(row, "rejected", 2)
        n = common_prefix(c, r)
        if n == 0:
            raise BadRow("no_common_prompt")
        if n >= min(len(c), len(r)):
            raise BadRow("empty_response")
        if any(m["role"] != "assistant" for m in c[n:] + r[n:]):
            raise BadRow("response_not_assistant")
        return c[:n], c[n:], r[n:]
    c, r = _text(row, "chosen"), _text(row, "rejected")
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
    row_id, system = _row_id(row), _system(row)
    if layout == "explicit":
        prompt = _text(row, "prompt")
        chosen, rejected = _text(row, "chosen"), _text(row, "rejected")
    elif layout == "conversational":
        prompt = _messages(row, "prompt")
        chosen, rejected = _messages(row, "chosen"), _messages(row, "rejected")
        if any(m["role"] != "assistant" for m in chosen + rejected):
            raise BadRow("response_not_assistant")
        if any(not m["content"].strip() for m in chosen + rejected):
            raise BadRow("empty_response")
        if any(m["role"] == "system" for m in prompt[1:]):
            raise BadRow("system_not_first")
        if system is not None and prompt[0]["role"] == "system":
            raise BadRow("system_conflict")
    elif layout == "implicit":
        prompt, chosen, rejected = _implicit(row)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if chosen == rejected:
        raise BadRow("chosen_equals_rejected")
    return Conversation(row_id, source, line, layout, system, prompt, chosen, rejected)


def read_conversations(path: Path, layout: str | None = None
                       ) -> Iterator[Conversation | Reject]:
    """Every row of every file under ``path``, as a Conversation or a Reject."""
    for file in list_files(path):
        file_layout = layout
        for line, raw, problem in read_raw(file):
            if problem is not None:
                yield Reject(str(file), line, problem, raw)
                continue
            file_layout = file_layout or detect_layout(raw)
            if file_layout is None:
                yield Reject(str(file), line, "unknown_layout", raw)
                continue
            try:
                yield validate(raw, file_layout, str(file), line)
            except BadRow as err:
                yield Reject(str(file), line, str(err), raw)
