"""What a tokenized preference dataset holds that training would not warn about: pairs
that became one after truncation (tokenize drops them: ``identical_after_truncation``),
length bias (chosen longer than rejected by habit: DPO learns the length), responses that
repeat their prompt, duplicate prompts (exact, and once case, spacing and punctuation are
set aside) and prompts found in more than one split. ``pomona data check`` prints it; the
pipeline's tokenize task shows it as a Prefect artifact. Each finding names rows by id.

Limits (``CheckLimits``) mark a finding over them: a warning, or a failure with
``--strict``. Length bias is the paired Cohen's d of chosen − rejected tokens (their mean
difference over its standard deviation, d_z) and the share of pairs whose chosen is longer.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPLITS = ("train", "valid", "test")
SHOWN = 5  # row ids a finding names


def _limit(default: float, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class CheckLimits:
    """The values past which a finding is reported as over its limit."""

    length_bias_d: float = _limit(0.5, "Most |Cohen's d| of chosen − rejected tokens (0.5: "
                                       "a medium effect).")
    chosen_longer: float = _limit(0.75, "Most share of pairs whose chosen is longer.")
    repeats_prompt: float = _limit(0.05, "Most share of pairs with a response holding its "
                                         "prompt.")
    duplicate_prompts: float = _limit(0.05, "Most share of a split's rows whose prompt "
                                            "another row has.")
    cross_split: int = _limit(0, "Most prompts found in more than one split.")

    def __post_init__(self) -> None:
        for name in ("length_bias_d", "chosen_longer", "repeats_prompt", "duplicate_prompts",
                     "cross_split"):
            value = getattr(self, name)
            if not value >= 0 or (name != "length_bias_d" and name != "cross_split"
                                  and value > 1):
                bound = ">= 0" if name in ("length_bias_d", "cross_split") else "in [0, 1]"
                raise ValueError(f"--max-{name.replace('_', '-')} {value}: expected {bound}")


@dataclass(frozen=True)
class Finding:
    """One check's result on one split (``all``: across splits)."""

    split: str
    check: str
    value: float
    limit: float
    ids: tuple[str, ...] = ()
    note: str = ""

    @property
    def over(self) -> bool:
        return abs(self.value) > self.limit

    def line(self) -> str:
        mark = "over its limit" if self.over else "within its limit"
        named = f"; rows {', '.join(self.ids)}" if self.ids else ""
        return (f"{self.split}: {self.check} {self.value:.3g} ({mark} {self.limit:g})"
                f"{': ' + self.note if self.note else ''}{named}")


@dataclass
class CheckReport:
    """Every finding, and the rows each split held."""

    rows: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def over(self) -> list[Finding]:
        return [f for f in self.findings if f.over]

    def markdown(self) -> str:
        """The report as a markdown table (the tokenize task's artifact)."""
        lines = ["| split | check | value | limit | over | rows |", "|---|---|---|---|---|---|"]
        lines += [f"| {f.split} | {f.check} | {f.value:.3g} | {f.limit:g} | "
                  f"{'yes' if f.over else 'no'} | {', '.join(f.ids)} |" for f in self.findings]
        return "\n".join(lines)


def normalised(text: str) -> str:
    """``text`` with case, spacing and punctuation set aside."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def check_dataset(path: Path, raw: Path, limits: CheckLimits = CheckLimits()
                  ) -> CheckReport:
    """The checks on the tokenized pair dataset at ``path`` (its splits and token counts;
    the texts as ``raw``, the files it was tokenized from, wrote them: a chat template's
    words are no part of a prompt) and on the rows tokenize dropped (its rejects file)."""
    from engine.data.pairs import load_pairs
    from tasks.data.preference_rows import raw_rows

    pairs = load_pairs(path)
    report = CheckReport({s: len(pairs.split(s)) for s in SPLITS})
    report.findings.append(dropped_identical(path, sum(report.rows.values())))
    written = {r["id"]: r for r in raw_rows(raw)}
    texts = {s: [written[p.id] for p in pairs.split(s) if p.id in written] for s in SPLITS}
    for split in SPLITS:
        kept = [p for p in pairs.split(split) if p.id in written]
        if kept:
            report.findings += split_findings(split, kept, texts[split], limits)
    report.findings.append(cross_split(texts, limits))
    return report


def dropped_identical(path: Path, kept: int) -> Finding:
    """The pairs tokenize dropped as identical once truncated (never trained on)."""
    rejects = path.parent / f"{path.name}.rejects.jsonl"
    rows = [json.loads(x) for x in rejects.read_text().splitlines() if x.strip()] if (
        rejects.is_file()) else []
    ids = [str(r.get("raw")) for r in rows  # a row dropped past parsing: raw is its id
           if r.get("reason") == "identical_after_truncation"]
    share = len(ids) / max(kept + len(ids), 1)
    return Finding("all", "identical_after_truncation (dropped)", share, 0.0,
                   tuple(ids[:SHOWN]), f"{len(ids)} pairs; raise --max-length")


def split_findings(split: str, pairs: list, texts: list[dict[str, str]],
                   limits: CheckLimits) -> list[Finding]:
    """Length bias, repeated prompts and duplicate prompts on one split."""
    import numpy as np

    diff = np.array([len(p.chosen) - len(p.rejected) for p in pairs], dtype=np.float64)
    sd = diff.std(ddof=1) if len(diff) > 1 else 0.0
    d = float(diff.mean() / sd) if sd > 0 else 0.0
    longer = [t["id"] for t, x in zip(texts, diff, strict=True) if x > 0]
    farthest = tuple(texts[i]["id"] for i in np.argsort(-np.abs(diff))[:SHOWN])
    repeats = [t["id"] for t in texts if repeats_prompt(t)]
    return [
        Finding(split, "length bias d (chosen − rejected tokens)", d, limits.length_bias_d,
                farthest, f"mean {diff.mean():+.1f} tokens; rows: the largest differences"),
        Finding(split, "chosen longer", len(longer) / len(texts), limits.chosen_longer,
                tuple(longer[:SHOWN])),
        Finding(split, "responses repeating the prompt", len(repeats) / len(texts),
                limits.repeats_prompt, tuple(repeats[:SHOWN]), f"{len(repeats)} pairs"),
        *duplicates(split, texts, limits)]


def repeats_prompt(row: dict[str, str]) -> bool:
    """Whether a response holds its whole prompt (case and spacing aside)."""
    prompt = normalised(row["prompt"])
    return bool(prompt) and any(prompt in normalised(row[k]) for k in ("chosen", "rejected"))


def duplicates(split: str, texts: list[dict[str, str]], limits: CheckLimits
               ) -> list[Finding]:
    """Rows whose prompt another row of the split has: exactly, and normalised."""
    out = []
    for name, key in (("exact", lambda t: t["prompt"]), ("normalised", normalised_prompt)):
        groups: dict[str, list[str]] = defaultdict(list)
        for t in texts:
            groups[key(t)].append(t["id"])
        repeated = [ids for ids in groups.values() if len(ids) > 1]
        rows = sum(len(ids) for ids in repeated)
        out.append(Finding(split, f"duplicate prompts ({name})", rows / len(texts),
                           limits.duplicate_prompts, tuple(i for ids in repeated[:SHOWN]
                                                           for i in ids[:2]),
                           f"{len(repeated)} prompts shared by {rows} rows"))
    return out


def normalised_prompt(row: dict[str, str]) -> str:
    return normalised(row["prompt"])


def cross_split(texts: dict[str, list[dict[str, str]]], limits: CheckLimits) -> Finding:
    """Prompts (normalised) in more than one split: a test prompt seen in training."""
    where: dict[str, set[str]] = defaultdict(set)
    first: dict[str, str] = {}
    for split, rows in texts.items():
        for t in rows:
            key = normalised(t["prompt"])
            where[key].add(split)
            first.setdefault(key, t["id"])
    shared = [first[k] for k, splits in where.items() if len(splits) > 1]
    return Finding("all", "prompts in more than one split", len(shared), limits.cross_split,
                   tuple(shared[:SHOWN]), f"{len(shared)} prompts")
