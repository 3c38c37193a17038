"""DPO's reference log-probs: computed once, stored as data, read by every DPO run.

The reference is the base model with LoRA off (``reference: base``) or the base with an
adapter (``reference: DIR``, SFT then DPO): no second copy of the weights is ever held
while training. Its summed response log-probs for every pair of a dataset (all splits:
validation and scoring read them too) come from the engine's forward-only path
(engine/forward/scoring.py: ``stack.hidden``, the bounded head, one shared forward per pair where
the layout pays; never the full logits), in the model's own dtype, and go to a Parquet
file with columns ``id``, ``ref_chosen_logps``, ``ref_rejected_logps``.

The file is keyed by content (``ReferenceSpec.key``): the model's bytes, the dataset's
shard bytes, the reference adapter's bytes and ``REFERENCE_VERSION``, never their paths.
It lives in ``reference/<key>.parquet`` of the cache root (engine/host/cache.py) and
carries its key in the schema metadata, so a file made for another model, dataset or
adapter is refused at read time naming both keys. One process computes a missing file
while others wait on its lock (ranks of one gang, trials of one sweep).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.tuner.utils import linear_to_lora_layers

from engine.data.batch import Pair
from engine.data.data_fit import load_pairs_for
from engine.data.unpaired import PARTNER_RULE, holds_unpaired
from engine.forward.layout_policy import scoring_layout
from engine.forward.scoring import forward_groups
from engine.host.cache import cache_root
from engine.host.digests import file_digest
from engine.model.adapters import load_adapter_weights
from engine.model.content_key import model_fingerprint, reference_key
from engine.model.load import use_input_dtype_lora
from engine.settings.forward_options import ForwardOptions
from engine.settings.reference_kind import (
    BASE,
    AdapterRef,
    Reference,
    parse_reference,
)
from engine.train.prepared import Prepared, prepare_scoring
from engine.train.reference_file import read_reference, reserve, write_reference

REFERENCE_VERSION = "1"  # bump when the forward's semantics change: old files are not read
KL_PARTNERS = "~kl"  # a KL partner's id is its pair's and this (and keys a file that has them)
# The pass never materialises [tokens, vocab] logits: a run with the dense head (0) still
# gets the bounded one here (Gemma's 262k vocabulary × 8k tokens would be 8 GB in fp32).
REFERENCE_HEAD_CHUNK = 256
log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]  # (pairs done, pairs in all)
# The pass's options where a caller gives none: 8 pairs a forward, the bounded head.
PASS = ForwardOptions(batch_size=8, head_chunk=REFERENCE_HEAD_CHUNK)


@dataclass(frozen=True)
class ReferenceSpec:
    """Whose log-probs, on what: ``model`` (directory, .gguf or hub id), ``data`` (a
    tokenized dataset or file) and ``reference`` (``BASE``, or an adapter); with
    ``kl``, the pairs' KL partners' too (``kl_partners``: KTO's reference point)."""

    model: str
    data: str
    reference: Reference = BASE
    kl: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "reference", parse_reference(self.reference))

    def key(self) -> str:
        """The content key (engine/model/content_key.py digests, cached by file stat)."""
        adapter = reference_key(self.reference)
        partners = {"kl_partners": KL_PARTNERS} if self.kl else {}  # DPO's keys unchanged
        if holds_unpaired(Path(self.data)):  # its rows' partners: how they are drawn
            partners["unpaired_partners"] = PARTNER_RULE
        body = json.dumps({"model": model_fingerprint(self.model),
                           "data": data_digest(self.data), "reference": adapter,
                           "version": REFERENCE_VERSION, **partners}, sort_keys=True)
        return "ref-" + hashlib.sha256(body.encode()).hexdigest()[:32]


def kl_partners(pairs: Sequence[Pair]) -> list[Pair]:
    """Each pair's KL partner, a mismatched pair: its prompt with the previous pair's
    responses, in the split's order (TRL's KTO ``_get_kl_dataset``: completions offset by
    one; the first takes the last's). A split of one pair is its own partner."""
    return [Pair(f"{p.id}{KL_PARTNERS}", p.prompt, q.chosen, q.rejected)
            for p, q in zip(pairs, [*pairs[-1:], *pairs[:-1]], strict=True)]


def with_partners(pairs: Sequence[Pair], refs: dict[str, tuple[float, float]],
                  where: str | Path) -> list[Pair]:
    """``pairs`` carrying their KL partners, each with its reference log-probs from
    ``refs`` (a partner missing there is an error naming it and the file)."""
    return [replace(p, kl=q) for p, q in zip(pairs, with_reference(kl_partners(pairs), refs,
                                                                   where), strict=True)]


def resolved_reference(reference: str | Reference) -> Reference:
    """``reference`` as stored and keyed: ``BASE``, or the adapter at its absolute path (a
    relative one would name another folder, or none, where score later runs)."""
    reference = parse_reference(reference)
    return reference.resolved() if isinstance(reference, AdapterRef) else reference


def cache_dir() -> Path:
    """``reference/`` of the one cache root (engine/host/cache.py)."""
    return cache_root() / "reference"


def data_digest(data: str | Path) -> str:
    """The bytes a dataset's pairs come from: its shards (a dataset directory) or the file."""
    path = Path(data)
    if path.is_dir():
        shards = sorted(p for p in path.iterdir()
                        if p.suffix in (".parquet", ".arrow", ".jsonl") and p.is_file())
        if not shards:
            raise FileNotFoundError(f"{data}: no dataset shards in this directory")
        body = json.dumps({p.name: file_digest(p) for p in shards}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()
    if not path.is_file():
        raise FileNotFoundError(f"{data}: no such dataset")
    return file_digest(path)


def prepare_reference(spec: ReferenceSpec) -> Prepared:
    """The reference model, set up for scoring: the base, or the base with
    ``spec.reference``'s LoRA attached as its config says. An adapter that does not fit
    the base (another model, size or family) is refused here, before any forward, in one
    line."""
    if not isinstance(spec.reference, AdapterRef):
        return prepare_scoring(spec.model)
    folder = Path(spec.reference.path).expanduser()
    config = _adapter_config(folder)
    return prepare_scoring(spec.model, attach=lambda model: _attach_reference_adapter(
        model, folder, config, spec.model))


def _adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"reference {folder}: not an adapter directory (no "
                                "adapter_config.json); use 'base' or an adapter folder")
    try:
        config = json.loads(path.read_text())
        params = config["lora_parameters"]
        int(config.get("num_layers", -1))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not an mlx-lm LoRA adapter config ({err})") from None
    if config.get("fine_tune_type", "lora") != "lora" or not isinstance(params, dict):
        raise ValueError(f"{path}: fine_tune_type {config.get('fine_tune_type')!r}: a "
                         "reference adapter must be LoRA")
    return config


def check_reference_base(folder: Path, config: dict[str, Any], base: str) -> None:
    """Refuse a reference adapter whose config records another base's content key: one
    trained on a base of the same shape (another seed) fits every tensor, so shapes alone
    cannot tell. Configs other tools wrote carry no key and are checked by shape only."""
    block = config.get("pomona")
    recorded = block.get("model_key") if isinstance(block, dict) else None
    if recorded and recorded != (found := model_fingerprint(base)):
        raise ValueError(f"reference adapter {folder} does not fit model {base}: trained "
                         f"on base {recorded}, this one is {found}; give the adapter "
                         "trained on this base")


def _attach_reference_adapter(model: Any, folder: Path, config: dict[str, Any],
                              base: str) -> None:
    check_reference_base(folder, config, base)
    model.freeze()
    try:
        linear_to_lora_layers(model, int(config.get("num_layers", -1)),
                              config["lora_parameters"])
        use_input_dtype_lora(model)  # as the policy's LoRA computes (engine/model/load.py)
        load_adapter_weights(model, folder)
    except (ValueError, KeyError, TypeError) as err:
        first = str(err).replace("\n ", "").splitlines()[0]
        raise ValueError(f"reference adapter {folder} does not fit model {base}: "
                         f"{first}") from None
    model.eval()


def compute_reference(spec: ReferenceSpec, options: ForwardOptions = PASS,
                      progress: Progress | None = None) -> dict[str, tuple[float, float]]:
    """Summed response log-probs of the reference for every pair of ``spec.data``: one
    forward-only pass (no gradient, the bounded head, the scoring layout), by length."""
    started = time.perf_counter()
    prepared = prepare_reference(spec)
    model, stack = prepared.model, prepared.stack
    data = load_pairs_for(spec.data, spec.model, stack, options.allow_tokenizer_mismatch)
    pairs = [*data.train, *data.valid, *data.test]
    seen: dict[str, Pair] = {}
    for p in pairs:  # the file keys pairs by id: two different pairs under one would share
        first = seen.setdefault(p.id, p)  # (identical rows, as tokenize ids them, may)
        if (first.prompt, first.chosen, first.rejected) != (p.prompt, p.chosen, p.rejected):
            raise ValueError(f"{spec.data}: pair id {p.id!r} names two different pairs; "
                             "DPO's reference log-probs are kept by id: give each its own")
    if spec.kl:  # the partners of each split, in the order training and scoring read them
        pairs += [q for split in (data.train, data.valid, data.test) for q in kl_partners(split)]
    layout = scoring_layout(options.prefix_share, prepared.pad_id, "full")
    loaded = time.perf_counter()
    refs = reference_logps(model, stack, pairs, layout, options.batch_size,
                           options.head_chunk or REFERENCE_HEAD_CHUNK, progress)
    seconds = time.perf_counter() - loaded
    log.info("reference log-probs: %d pairs in %.1f s (%.3f s a pair; load and check %.1f s)",
             len(pairs), seconds, seconds / max(len(pairs), 1), loaded - started)
    del model, stack, prepared
    mx.clear_cache()  # the trainer loads its own copy next
    return refs


def reference_logps(model: Any, stack: Any, pairs: Sequence[Pair],
                    layout: Callable[[list[Pair]], Any], batch_size: int, head_chunk: int,
                    progress: Progress | None = None) -> dict[str, tuple[float, float]]:
    """Per pair id, (chosen, rejected) summed response log-probs in float32 under
    ``model`` as it stands (engine/forward/scoring.py's forward)."""
    out: dict[str, tuple[float, float]] = {}
    done, last = 0, time.monotonic()
    for idx, two, lp in forward_groups(model, stack, pairs, batch_size, layout, head_chunk,
                                       nll=False):
        group = [pairs[i] for i in idx]
        sums = (lp.astype(mx.float32) * mx.array(two.resp_mask)).sum(axis=-1)
        mx.eval(sums)
        k = len(group)
        values = sums.tolist()
        for j, p in enumerate(group):
            out[p.id] = (values[j], values[k + j])
        done += k
        if progress is not None:
            progress(done, len(pairs))
        if time.monotonic() - last > 10 or done == len(pairs):
            log.info("reference log-probs: %d/%d pairs", done, len(pairs))
            last = time.monotonic()
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # said, so a wait behind another process is not a hang
            log.info("reference log-probs: another process is making %s; waiting", path.name)
            fcntl.flock(f, fcntl.LOCK_EX)  # released on close, or when the process dies
        yield


def ensure_reference(spec: ReferenceSpec, path: str | Path | None = None,
                     options: ForwardOptions = PASS, progress: Progress | None = None
                     ) -> tuple[Path, bool]:
    """The reference file for ``spec`` and whether it was cached: ``path`` when given
    (read, never written: it must carry the key), else the cache's file, computed now
    (``compute_reference``'s ``options``) when missing or unreadable."""
    key = spec.key()
    if path is not None:
        read_reference(path, key)
        return Path(path), True
    target = cache_dir() / f"{key}.parquet"
    try:  # no lock: a read-only cache
        read_reference(target, key)
        log.info("reference log-probs: cached (%s)", target)
        return target, True
    except FileNotFoundError:
        pass
    except ValueError as err:  # Pomona's own file, edited or damaged: made again, said
        log.warning("reference log-probs: %s; computing it again", err)
    with _locked(target):
        with contextlib.suppress(FileNotFoundError, ValueError):
            read_reference(target, key)
            log.info("reference log-probs: cached (%s)", target)
            return target, True
        log.info("reference log-probs: computing %s for %s on %s (one forward per pair)",
                 "the base model" if spec.reference == BASE else spec.reference,
                 spec.model, spec.data)
        reserve(target)  # a full disk is said now, not after the whole pass
        write_reference(target, key, compute_reference(spec, options, progress))
    return target, False


def with_reference(pairs: Sequence[Pair], refs: dict[str, tuple[float, float]],
                   where: str | Path) -> list[Pair]:
    """``pairs`` carrying their reference log-probs; a pair without one is an error
    naming its id and the file (the file and the dataset disagree)."""
    out = []
    for p in pairs:
        if p.id not in refs:
            raise ValueError(f"{where}: no reference log-probs for pair id {p.id!r}")
        out.append(replace(p, ref=refs[p.id]))
    return out


def attach_reference(pairs: Any, spec: ReferenceSpec, path: str | Path | None = None,
                     options: ForwardOptions = PASS) -> Path:
    """Give every pair of a PairSet (engine/data/pairs.py) its reference log-probs, made or
    read through ``ensure_reference``; returns the file they came from."""
    key = spec.key()
    where = Path(path) if path is not None else cache_dir() / f"{key}.parquet"
    try:
        refs = read_reference(where, key)
    except (FileNotFoundError, ValueError):
        if path is not None:  # the user's file: never replaced
            raise
        where, _ = ensure_reference(spec, None, options)
        refs = read_reference(where, key)
    for split in ("train", "valid", "test"):
        setattr(pairs, split, with_reference(getattr(pairs, split), refs, where))
        if spec.kl:
            if len(getattr(pairs, split)) == 1:  # kl_partners has no other pair to offset to
                log.warning("KTO: the %s split of %s holds a single pair, so it is its own KL "
                            "partner: the KL reference point then reads the pair itself, not "
                            "a mismatched one; give the split more pairs", split, spec.data)
            setattr(pairs, split, with_partners(getattr(pairs, split), refs, where))
    return where
