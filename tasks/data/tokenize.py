"""``pomona data tokenize``: preference files → a tokenized Arrow dataset, cached by content.

Reads every row (tasks/data/preference_rows.py), renders and tokenizes them in batches with the
fast tokenizer's multi-threaded ``encode_batch`` (tasks/data/render.py), truncates (by default
to the model's context length), and writes the dataset directory (tasks/data/dataset_dir.py)
keyed by a fingerprint of the input bytes, the tokenizer files, the options and the
data-code version: an unchanged re-run is a cache hit. Bad rows go to
``<out>.rejects.jsonl`` beside it; the run fails only above ``max_bad_fraction`` (its
rejects then go to ``<out>.failed.rejects.jsonl``, leaving the dataset's own untouched); a
user's file under either name is refused, never replaced. One writer at a time, and none
while a training run or sweep reads the dataset (engine/host/outputs.py: ``replacing``).
Pairs far longer than the rest are reported as outliers: one can exhaust training memory.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from engine.data.pairs import split_counts, split_notes, stable_split
from engine.data.shards import SPLIT_BY, shards_problem
from engine.host.atomic import atomic_write_bytes
from engine.host.digests import file_digest, file_digests, sha256_file, tokenizer_hash
from engine.host.outputs import RefusedOutput, check_apart, replacing
from engine.model.source import model_dir, read_config
from tasks.data import prompt_tokens
from tasks.data.dataset_dir import (
    check_replaceable,
    read_manifest,
    read_table,
    write_dataset,
)
from tasks.data.pair_encoder import PairEncoder
from tasks.data.preference_rows import Conversation, Reject, list_files, read_conversations
from tasks.data.render import ChatTemplate, Truncation, render, truncate
from tasks.data.tokenize_options import TokenizeOptions

# Bump when rendering/tokenization changes what gets written (3: split by prompt, SPLIT_BY).
DATA_CODE_VERSION = "3"
# config.json keys that hold a model's context length, across families.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "n_ctx", "max_sequence_length")
OUTLIER_FACTOR = 4  # a pair this many times the p99 length is reported
COLUMNS = ("id", "group", "prompt_ids", "chosen_ids", "rejected_ids")
Progress = Callable[[int, int], None]  # (rows read, tokens written so far)


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
    outliers: dict[str, Any] = field(default_factory=dict)  # the manifest's "outliers"
    notes: list[str] = field(default_factory=list)  # an empty valid/test split, a rebuild

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class TooManyBadRows(ValueError):
    """More than ``max_bad_fraction`` of the rows were rejected."""


class NoRows(ValueError):
    """The input holds no rows, or no usable one: a 0-row dataset would train nothing."""


@dataclass
class _Collected:
    """What reading and tokenizing every row produced."""

    rows: dict[str, list] = field(default_factory=lambda: {
        k: [] for k in (*COLUMNS, "answer", "label")})
    where: list[tuple[str, int]] = field(default_factory=list)  # (source, line) per row
    rejects: list[Reject] = field(default_factory=list)
    trunc: Counter = field(default_factory=Counter)
    read: int = 0
    kind: str | None = None  # pairs, prompts, unpaired: its first row's (prompt_tokens.py)


def fingerprint(files: list[Path], folder: Path, options: TokenizeOptions) -> str:
    """The dataset's cache key: its inputs' SHA-256 (engine/host/digests.py, kept by file
    stat: a cache hit reads no input again), the tokenizer, the options, the code."""
    body = {"sources": file_digests(files), "tokenizer": tokenizer_hash(folder),
            "options": asdict(options), "code": DATA_CODE_VERSION}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _split_rows(manifest: dict[str, Any]) -> dict[str, int]:
    """Rows per split as a manifest counts them (one from before the test split: none)."""
    rows = manifest.get("rows") or {}
    return {name: int(rows.get(name) or 0) for name in ("train", "valid", "test")}


def context_length(folder: Path) -> int:
    """The model's context length from its config.json (0 when it states none)."""
    try:
        config = read_config(folder)
    except (OSError, ValueError):
        return 0
    nested = config.get("text_config")
    for cfg in (config, nested):  # multimodal configs nest it under text_config
        for key in CONTEXT_KEYS if isinstance(cfg, dict) else ():
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return 0


def rejects_paths(out: Path) -> tuple[Path, Path]:
    """Where a run's rejects go: (beside a written dataset, after a failed run)."""
    out = Path(out)
    return (out.parent / f"{out.name}.rejects.jsonl",
            out.parent / f"{out.name}.failed.rejects.jsonl")


def _load_tokenizer(folder: Path) -> Any:
    """The fast (Hugging Face) tokenizer of ``folder``, or ValueError naming it."""
    from mlx_lm.utils import load_tokenizer

    try:
        tokenizer = load_tokenizer(folder)
    except Exception as err:  # transformers raises many types for a missing/odd tokenizer
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"--model {folder}: cannot load its tokenizer ({first}); it needs "
                         "tokenizer.json and tokenizer_config.json") from err
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _tokenize_batch(convs: list[Conversation], encoder: PairEncoder,
                    template: ChatTemplate | None, limits: Truncation, got: _Collected) -> None:
    convs = prompt_tokens.keep_one_kind(convs, got)
    if prompt_tokens.tokenize_kind(convs, encoder, template, limits, got):  # not pairs
        return
    rendered, kept = [], []
    for c in convs:
        try:
            rendered.append(render(c, template))
            kept.append(c)
        except Exception as err:  # a template may raise on odd content: reject the row
            reason = str(err) if str(err) == "template_mismatch" else "template_error"
            got.rejects.append(Reject(c.source, c.line, reason, c.id))
    for c, pair in zip(kept, encoder.pairs(rendered), strict=True):
        pair, reasons = truncate(pair, limits, encoder.bos)
        got.trunc.update(r for r in reasons if r.startswith("truncated"))
        if pair is None:
            got.rejects.append(Reject(c.source, c.line, reasons[-1], c.id))
            continue
        if pair.boundary_merged:
            got.trunc["boundary_merged"] += 1
        got.where.append((c.source, c.line))
        got.rows["id"].append(c.id)
        got.rows["group"].append(c.group)
        got.rows["prompt_ids"].append(pair.prompt_ids)
        got.rows["chosen_ids"].append(pair.chosen_ids)
        got.rows["rejected_ids"].append(pair.rejected_ids)


def _count_tokens(rows: dict[str, list]) -> int:
    """Tokens of both full sequences of every pair (what two forwards would process); a
    prompt row's prompt."""
    return sum(len(p) * (1 + bool(r)) + len(c) + len(r) for p, c, r in
               zip(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"], strict=True))


def _read_and_tokenize(inputs: Path, options: TokenizeOptions, encoder: PairEncoder,
                       template: ChatTemplate | None, progress: Progress | None) -> _Collected:
    got, pending = _Collected(), []
    limits = Truncation(options.max_length or 0, options.max_prompt_length)
    counted = counted_rows = 0
    for item in read_conversations(inputs, options.layout):
        got.read += 1
        if isinstance(item, Reject):
            got.rejects.append(item)
            continue
        pending.append(item)
        if len(pending) >= options.batch_rows:
            _tokenize_batch(pending, encoder, template, limits, got)
            pending = []
            if progress:  # tokens of the rows written so far, counted once each
                counted += _count_tokens({k: v[counted_rows:] for k, v in got.rows.items()})
                counted_rows = len(got.rows["id"])
                progress(got.read, counted)
    _tokenize_batch(pending, encoder, template, limits, got)
    if progress:
        progress(got.read, _count_tokens(got.rows))
    return got


def _length_stats(lists: list[list[int]]) -> dict[str, float]:
    if not lists:
        return {}
    n = np.array([len(x) for x in lists])
    p50, p95, p99 = np.percentile(n, [50, 95, 99])
    return {"mean": float(n.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99),
            "max": int(n.max())}


def _outliers(got: _Collected) -> dict[str, Any]:
    """Pairs longer than OUTLIER_FACTOR × the p99 branch length, longest first (5 named).

    The p99 is the nearest row below it ("lower"): one huge row in a small file would
    otherwise drag an interpolated p99 up towards itself and hide.
    """
    r = got.rows
    lengths = np.array([len(p) + max(len(c), len(j)) for p, c, j in
                        zip(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"], strict=True)])
    if not len(lengths):
        return {}
    p99 = int(np.percentile(lengths, 99, method="lower"))
    over = sorted(np.flatnonzero(lengths > OUTLIER_FACTOR * p99), key=lambda i: -lengths[i])
    rows = [{"id": r["id"][i], "source": got.where[i][0], "line": got.where[i][1],
             "tokens": int(lengths[i])} for i in over[:5]]
    return {"factor": OUTLIER_FACTOR, "p99": p99, "count": len(over), "rows": rows}


def _write_rejects(path: Path, rejects: list[Reject]) -> None:
    """Write atomically under a unique temporary: a crash leaves the previous file, never
    half of one, and no file of a user's is written over."""
    text = "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rejects)
    # backslashreplace writes a lone surrogate back as the JSON escape it was read from
    atomic_write_bytes(path, text.encode("utf-8", "backslashreplace"))


REJECT_KEYS = Reject("", 0, "", None).to_json().keys()


def is_rejects_file(path: Path) -> bool:
    """Whether ``path`` holds rejects a tokenize run wrote (its mark: every line one JSON
    object with exactly a reject's keys), the only file beside ``--out`` it replaces."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return all(isinstance(row := json.loads(line), dict) and row.keys() == REJECT_KEYS
                       for line in f if line.strip())
    except (OSError, ValueError):
        return False


def _fail_if_unusable(got: _Collected, inputs: Path, files: list[Path], limit: float,
                      failed: Path) -> None:
    """Raise NoRows or TooManyBadRows; their rejects go to ``failed``, not beside ``out``."""
    if got.read == 0:
        names = ", ".join(str(f) for f in files[:3]) + (" …" if len(files) > 3 else "")
        raise NoRows(f"--input {inputs}: no rows to tokenize (read {names}). Check the "
                     "file is the one you meant")
    bad = len(got.rejects)
    if bad / got.read <= limit and got.rows["id"]:
        return
    _write_rejects(failed, got.rejects)
    reasons = Counter(r.reason for r in got.rejects).most_common(3)
    worst = Counter(r.source for r in got.rejects).most_common(3)
    detail = (f"Worst reasons: {', '.join(f'{k} ({v})' for k, v in reasons)}; worst files: "
              f"{', '.join(f'{k} ({v})' for k, v in worst)}. See {failed}")
    if not got.rows["id"]:
        raise NoRows(f"all {got.read} rows of --input {inputs} are bad; no dataset written. "
                     f"{detail}")
    raise TooManyBadRows(f"{bad} of {got.read} rows ({bad / got.read:.1%}) are bad, above the "
                         f"{limit:.0%} limit. {detail}")


def _check_apart(out: Path, inputs: Path, files: list[Path]) -> None:
    """Refuse an --out (or its rejects file) that is, holds or lies among the inputs, and a
    rejects file's name that holds a file of the user's."""
    check_apart(out, [inputs, *files])
    for path in rejects_paths(out):
        if any(path.resolve() == f.resolve() for f in files):
            raise RefusedOutput(f"--out {out}: its rejects file {path} is an input. Choose "
                                "another --out")
        if path.is_symlink() or (path.exists() and not is_rejects_file(path)):
            raise RefusedOutput(f"--out {out}: {path} (where its rejects go) holds a file "
                                "Pomona did not write; refusing to replace it. Move it or "
                                "choose another --out")


def _manifest(fp: str, folder: Path, options: TokenizeOptions, use_template: bool,
              files: list[Path], got: _Collected) -> dict[str, Any]:
    rows = got.rows
    return {
        "fingerprint": fp, "tokenizer": str(folder), "tokenizer_hash": tokenizer_hash(folder),
        "code_version": DATA_CODE_VERSION, "options": asdict(options), "split_by": SPLIT_BY,
        "chat_template": use_template, "preprocessed": False,
        "sources": [{"path": str(f), "sha256": file_digest(f)} for f in files],
        "rows": {"total": len(rows["id"]), **split_counts(rows["split"]), "read": got.read},
        "rejects": dict(Counter(r.reason for r in got.rejects)), "truncation": dict(got.trunc),
        "token_lengths": {k: _length_stats(rows[f"{k}_ids"])
                          for k in prompt_tokens.id_columns(got.kind)},
        "outliers": _outliers(got), "tokens": _count_tokens(rows),
        **prompt_tokens.manifest_kind(got.kind),
    }


def tokenize_dataset(inputs: str | Path, model: str, out: str | Path,
                     options: TokenizeOptions | None = None,
                     progress: Progress | None = None) -> TokenizeReport:
    """Tokenize preference files under ``inputs`` with ``model``'s tokenizer into ``out``
    (``options``: the defaults when None)."""
    started = time.perf_counter()
    options = options or TokenizeOptions()
    options.check()
    inputs, out = Path(inputs), Path(out)
    files = list_files(inputs)
    _check_apart(out, inputs, files)
    try:
        folder = model_dir(model)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"--{err}") from err  # the message opens "model ...": the option
    if options.max_length is None:  # the model's own limit: no pair longer than it can train
        options = replace(options, max_length=context_length(folder))
    fp = fingerprint(files, folder, options)
    if (hit := _cache_hit(out, fp, options, started)) is not None:
        return hit
    with replacing(out):  # one writer, and none while a run reads the dataset
        if (hit := _cache_hit(out, fp, options, started)) is not None:
            return hit  # a writer that finished meanwhile wrote these very bytes
        return _tokenize_into(out, inputs, files, folder, options, fp, progress, started)


def _cache_hit(out: Path, fp: str, options: TokenizeOptions, started: float
               ) -> TokenizeReport | None:
    """The report of a dataset at ``out`` that already holds fingerprint ``fp``, whole."""
    manifest = read_manifest(out)
    if (manifest is None or manifest.get("fingerprint") != fp
            or shards_problem(out, manifest, sha256_file)):
        return None
    return TokenizeReport(str(out), fp, True, manifest["rows"]["total"], manifest["rejects"],
                          manifest["truncation"], seconds=time.perf_counter() - started,
                          outliers=manifest.get("outliers", {}),
                          notes=split_notes(_split_rows(manifest), options.valid_fraction,
                                            options.test_fraction))


def resplit_note(out: Path, manifest: dict[str, Any], got: _Collected) -> str | None:
    """How many of the rows of the dataset at ``out``, tokenized before splits kept a
    prompt's pairs together, move split now (None for a dataset split by prompt already)."""
    if manifest.get("split_by") == SPLIT_BY:
        return None
    try:
        old = read_table(out, check=False).select(["id", "split"]).to_pydict()
    except (OSError, KeyError, pa.ArrowException):
        return None
    before = dict(zip(old["id"], old["split"], strict=True))
    moved = sum(before.get(i, s) != s for i, s in zip(got.rows["id"], got.rows["split"],
                                                        strict=True))
    return (f"{out}: re-split by prompt, so a prompt's pairs share one split (it was split "
            f"by row): {moved} of {len(got.rows['id'])} rows moved split")


def _tokenize_into(out: Path, inputs: Path, files: list[Path], folder: Path,
                   options: TokenizeOptions, fp: str, progress: Progress | None,
                   started: float) -> TokenizeReport:
    """Tokenize and write the dataset at ``out`` (its writer's lock held)."""
    manifest = read_manifest(out)
    broken = shards_problem(out, manifest, sha256_file) if manifest is not None else None
    notes = [f"{out}: {broken}; tokenizing again"] if broken else []
    check_replaceable(out)  # before the work, not only when writing (write_dataset checks)
    hf_tok = _load_tokenizer(folder)
    if options.chat_template == "on" and not hf_tok.chat_template:
        raise ValueError(f"--chat-template on: the tokenizer of {folder} has no chat "
                         "template. Use --chat-template off or auto")
    use_template = options.chat_template == "on" or (
        options.chat_template == "auto" and bool(hf_tok.chat_template))
    template = ChatTemplate(hf_tok) if use_template else None
    got = _read_and_tokenize(inputs, options, PairEncoder(hf_tok), template, progress)
    kept_path, failed_path = rejects_paths(out)
    _fail_if_unusable(got, inputs, files, options.max_bad_fraction, failed_path)
    got.rows["split"] = [stable_split(g, options.valid_fraction, options.test_fraction)
                         for g in got.rows["group"]]  # a prompt's pairs in one split
    if manifest is not None and not broken and (moved := resplit_note(out, manifest, got)):
        notes.append(moved)
    notes += split_notes(split_counts(got.rows["split"]), options.valid_fraction,
                         options.test_fraction)  # refuses an empty train split
    got.rows["prefix_shared"] = [None] * len(got.rows["id"])  # set by preprocess
    manifest = _manifest(fp, folder, options, use_template, files, got)
    rows, schema = prompt_tokens.columns(got.kind, got.rows)  # prompts: no responses
    write_dataset(out, rows, manifest, schema=schema)
    _write_rejects(kept_path, got.rejects)  # after the dataset: the two always match
    if failed_path.exists():  # an earlier failure's report no longer applies (checked ours)
        failed_path.unlink()
    return TokenizeReport(str(out), fp, False, manifest["rows"]["total"], manifest["rejects"],
                          dict(got.trunc), manifest["tokens"], time.perf_counter() - started,
                          manifest["outliers"], notes)
