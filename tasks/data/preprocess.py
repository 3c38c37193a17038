"""``pomona data preprocess``: split_prefix, de-duplication and the train/valid/test split.

Per row: ``prefix_shared`` — chosen and rejected begin with the same prompt tokens, so the
engine can run one forward over [prompt | chosen | rejected] — and the tokens that sharing
saves (the prompt, computed once instead of twice). Exact duplicate pairs are removed and
counted. The split is a stable hash of each row's ``group`` (its prompt, or the row's own
``group`` field), so a prompt's pairs share one split and adding rows never moves old
rows; a dataset tokenized before that rule is refused (engine/data/shards.py). ``out``
(default: in place) may only be a new or empty folder or another Pomona dataset.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from engine.data.pairs import split_counts, split_notes, stable_split
from engine.data.shards import check_dataset
from engine.data.splits import TEST_FRACTION, check_fractions
from engine.host.outputs import check_apart, reading, replacing
from tasks.data.dataset_dir import check_replaceable, read_manifest, read_table, write_dataset


@dataclass
class PreprocessReport:
    """What preprocessing found (small: crosses Prefect as is)."""

    out: str
    rows: int
    duplicates_removed: int
    prefix_share_rate: float
    tokens_saved: int
    tokens_two_forward: int
    notes: list[str] = field(default_factory=list)  # an empty valid or test split

    @property
    def saved_fraction(self) -> float:
        return self.tokens_saved / max(self.tokens_two_forward, 1)


def preprocess_dataset(path: str | Path, out: str | Path | None = None,
                       valid_fraction: float | None = None,
                       test_fraction: float | None = None) -> PreprocessReport:
    """Preprocess the dataset at ``path`` into ``out`` (default: in place, atomically);
    refused while another process reads or writes ``out``, or writes ``path``."""
    path = Path(path)
    out = Path(out) if out else path
    same = out.resolve() == path.resolve()
    with replacing(out), nullcontext() if same else reading(path):  # no writer swaps its input
        return _preprocess(path, out, valid_fraction, test_fraction)


def _preprocess(path: Path, out: Path, valid_fraction: float | None,
                test_fraction: float | None) -> PreprocessReport:
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(f"{path}: not a complete Pomona dataset (no valid manifest)")
    check_dataset(path, manifest)  # its rows carry the group each split is drawn from
    if manifest.get("kind") == "prompts":  # GRPO's rows: nothing of a pair's to share
        raise ValueError(f"{path}: a prompts dataset (prompts and answers, no pairs): "
                         "preprocess works on pairs; train on it as it is (--loss grpo)")
    if manifest.get("kind") == "unpaired":  # KTO's rows: a row and its KL partner share
        raise ValueError(f"{path}: an unpaired dataset (a prompt, one completion and a "
                         "label): preprocess works on pairs; train on it as it is "
                         "(--loss kto)")
    if out.resolve() != path.resolve():  # in place replaces the input, by design
        check_apart(out, [path])
        check_replaceable(out)
    options = manifest["options"]
    valid = options["valid_fraction"] if valid_fraction is None else valid_fraction
    test = options.get("test_fraction", TEST_FRACTION) if test_fraction is None else test_fraction
    check_fractions(valid, test)
    cols = read_table(path).to_pydict()
    seen: set[tuple] = set()
    keep: dict[str, list] = {k: [] for k in cols}
    dupes = saved = two_forward = 0
    for i in range(len(cols["id"])):
        key = (tuple(cols["prompt_ids"][i]), tuple(cols["chosen_ids"][i]),
               tuple(cols["rejected_ids"][i]))
        if key in seen:
            dupes += 1
            continue
        seen.add(key)
        p, c, r = (len(x) for x in key)
        shared = p > 0  # both sequences start with these prompt tokens, by construction
        for k in cols:
            keep[k].append(cols[k][i])
        keep["prefix_shared"][-1] = shared
        keep["split"][-1] = stable_split(cols["group"][i], valid, test)  # by prompt
        saved += p if shared else 0
        two_forward += 2 * p + c + r
    n = len(keep["id"])
    notes = split_notes(split_counts(keep["split"]), valid, test)  # refuses no train rows
    rate = sum(keep["prefix_shared"]) / max(n, 1)
    manifest = {k: v for k, v in manifest.items() if k not in ("schema_version", "shards")}
    manifest.update({
        "preprocessed": True,
        "rows": {**manifest["rows"], "total": n, **split_counts(keep["split"])},
        "duplicates_removed": dupes, "prefix_share_rate": rate, "tokens_saved": saved,
        "tokens_two_forward": two_forward,
        "options": {**options, "valid_fraction": valid, "test_fraction": test},
    })
    write_dataset(out, keep, manifest)
    return PreprocessReport(str(out), n, dupes, rate, saved, two_forward, notes)
