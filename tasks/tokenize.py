"""``pomona data tokenize``: preference files → a tokenized Arrow dataset, cached by content.

Reads every row (tasks/preference_rows.py), renders and tokenizes them in batches with the
fast tokenizer's multi-threaded ``encode_batch`` (tasks/render.py), truncates, and writes
the dataset directory (tasks/dataset_dir.py) keyed by a fingerprint of the input bytes, the
tokenizer files, the options and the data-code version: an unchanged re-run is a cache hit.
Bad rows go to ``rejects.jsonl`` beside it; the run fails only above ``max_bad_fraction``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.data import stable_split
from tasks.dataset_dir import read_manifest, write_dataset
from tasks.pair_encoder import PairEncoder
from tasks.preference_rows import Conversation, Reject, list_files, read_conversations
from tasks.render import ChatTemplate, Truncation, render, truncate

DATA_CODE_VERSION = "1"  # bump when rendering/tokenization changes what gets written
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model")
Progress = Callable[[int, int], None]  # (rows read, tokens written so far)


@dataclass(frozen=True)
class TokenizeOptions:
    """How files become token ids."""

    layout: str | None = None  # None: detect per file
    chat_template: str = "auto"  # auto (use it when the tokenizer has one) | on | off
    max_length: int = 0  # per branch, prompt + response; 0 = no limit
    max_prompt_length: int = 0
    valid_fraction: float = 0.1
    max_bad_fraction: float = 0.05
    batch_rows: int = 1024


@dataclass
class TokenizeReport:
    """What a tokenize run did (small: crosses Prefect as is)."""

    out: str
    fingerprint: str
    cache_hit: bool
    rows: int
    rejects: dict[str, int] = field(default_factory=dict)
    truncation: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class TooManyBadRows(ValueError):
    """More than ``max_bad_fraction`` of the rows were rejected."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_hash(model_dir: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            h.update(name.encode() + _sha256(Path(model_dir) / name).encode())
    return h.hexdigest()


def fingerprint(files: list[Path], model_dir: Path, options: TokenizeOptions) -> str:
    body = {"sources": [_sha256(f) for f in files], "tokenizer": tokenizer_hash(model_dir),
            "options": asdict(options), "code": DATA_CODE_VERSION}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _resolve_model_dir(model: str) -> Path:
    path = Path(model)
    if path.exists():
        return path
    from mlx_lm.utils import hf_repo_to_path  # a repo id: the local snapshot mlx-lm uses

    return Path(hf_repo_to_path(model))


def _tokenize_batch(convs: list[Conversation], encoder: PairEncoder,
                    template: ChatTemplate | None, limits: Truncation, out: dict[str, list],
                    rejects: list[Reject], trunc: Counter) -> None:
    rendered, kept = [], []
    for c in convs:
        try:
            rendered.append(render(c, template))
            kept.append(c)
        except Exception as err:  # a template may raise on odd content: reject the row
            reason = str(err) if str(err) == "template_mismatch" else "template_error"
            rejects.append(Reject(c.source, c.line, reason, c.id))
    for c, pair in zip(kept, encoder.pairs(rendered), strict=True):
        pair, reasons = truncate(pair, limits, encoder.bos)
        trunc.update(r for r in reasons if r.startswith("truncated"))
        if pair is None:
            rejects.append(Reject(c.source, c.line, reasons[-1], c.id))
            continue
        if pair.boundary_merged:
            trunc["boundary_merged"] += 1
        out["id"].append(c.id)
        out["prompt_ids"].append(pair.prompt_ids)
        out["chosen_ids"].append(pair.chosen_ids)
        out["rejected_ids"].append(pair.rejected_ids)


def _count_tokens(rows: dict[str, list]) -> int:
    """Tokens of both full sequences of every pair (what two forwards would process)."""
    return sum(len(p) * 2 + len(c) + len(r) for p, c, r in
               zip(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"], strict=True))


def _length_stats(lists: list[list[int]]) -> dict[str, float]:
    if not lists:
        return {}
    n = np.array([len(x) for x in lists])
    p50, p95, p99 = np.percentile(n, [50, 95, 99])
    return {"mean": float(n.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99),
            "max": int(n.max())}


def _fail_if_too_bad(rejects: list[Reject], total: int, limit: float) -> None:
    if total == 0 or len(rejects) / total <= limit:
        return
    reasons = Counter(r.reason for r in rejects).most_common(3)
    files = Counter(r.source for r in rejects).most_common(3)
    raise TooManyBadRows(
        f"{len(rejects)} of {total} rows ({len(rejects) / total:.1%}) are bad, above the "
        f"{limit:.0%} limit. Worst reasons: {', '.join(f'{k} ({v})' for k, v in reasons)}; "
        f"worst files: {', '.join(f'{k} ({v})' for k, v in files)}. See rejects.jsonl.")


def tokenize_dataset(inputs: str | Path, model: str, out: str | Path,
                     options: TokenizeOptions = TokenizeOptions(),
                     progress: Progress | None = None) -> TokenizeReport:
    """Tokenize preference files under ``inputs`` with ``model``'s tokenizer into ``out``."""
    from mlx_lm.utils import load_tokenizer

    started = time.perf_counter()
    out, files = Path(out), list_files(Path(inputs))
    model_dir = _resolve_model_dir(model)
    fp = fingerprint(files, model_dir, options)
    manifest = read_manifest(out)
    if manifest is not None and manifest.get("fingerprint") == fp:
        return TokenizeReport(str(out), fp, True, manifest["rows"]["total"],
                              manifest["rejects"], manifest["truncation"],
                              seconds=time.perf_counter() - started)
    tokenizer = load_tokenizer(model_dir)
    hf_tok = getattr(tokenizer, "_tokenizer", tokenizer)
    use_template = (options.chat_template == "on" or
                    (options.chat_template == "auto" and bool(hf_tok.chat_template)))
    encoder = PairEncoder(hf_tok)
    template = ChatTemplate(hf_tok) if use_template else None
    limits = Truncation(options.max_length, options.max_prompt_length)
    rows: dict[str, list] = {k: [] for k in ("id", "prompt_ids", "chosen_ids", "rejected_ids")}
    rejects: list[Reject] = []
    trunc: Counter = Counter()
    pending: list[Conversation] = []
    total = counted = counted_rows = 0
    for item in read_conversations(Path(inputs), options.layout):
        total += 1
        if isinstance(item, Reject):
            rejects.append(item)
            continue
        pending.append(item)
        if len(pending) >= options.batch_rows:
            _tokenize_batch(pending, encoder, template, limits, rows, rejects, trunc)
            pending = []
            if progress:  # tokens of the rows written so far, counted once each
                counted += _count_tokens({k: v[counted_rows:] for k, v in rows.items()})
                counted_rows = len(rows["id"])
                progress(total, counted)
    _tokenize_batch(pending, encoder, template, limits, rows, rejects, trunc)
    if progress:
        progress(total, _count_tokens(rows))

    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.rejects.jsonl").write_text(
        "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rejects))
    _fail_if_too_bad(rejects, total, options.max_bad_fraction)
    n = len(rows["id"])
    rows["split"] = [stable_split(i, options.valid_fraction) for i in rows["id"]]
    rows["prefix_shared"] = [None] * n  # set by preprocess
    tokens = _count_tokens(rows)
    manifest = {
        "fingerprint": fp, "tokenizer": str(model_dir), "tokenizer_hash": tokenizer_hash(model_dir),
        "code_version": DATA_CODE_VERSION, "options": asdict(options),
        "chat_template": use_template, "preprocessed": False,
        "sources": [{"path": str(f), "sha256": _sha256(f)} for f in files],
        "rows": {"total": n, "train": rows["split"].count("train"),
                 "valid": rows["split"].count("valid"), "read": total},
        "rejects": dict(Counter(r.reason for r in rejects)), "truncation": dict(trunc),
        "token_lengths": {k: _length_stats(rows[f"{k}_ids"])
                          for k in ("prompt", "chosen", "rejected")},
        "tokens": tokens,
    }
    write_dataset(out, rows, manifest)
    return TokenizeReport(str(out), fp, False, n, manifest["rejects"], dict(trunc), tokens,
                          time.perf_counter() - started)
