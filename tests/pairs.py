"""Test helpers: synthetic rows → tokenized pairs with a model's own tokenizer (raw text), and
a reference log-prob file for a dataset's pair ids."""

from __future__ import annotations

from pathlib import Path

from engine.data.batch import Pair
from engine.settings.forward_options import ForwardOptions
from tasks.data.synthetic import synth_rows

# The reference pass's options in the reference tests: small batches, a bounded head.
REFERENCE_OPTIONS = ForwardOptions(batch_size=4, head_chunk=16, prefix_share="auto")


def tokenized_pairs(model_dir: Path, n: int, seed: int = 0, task: str = "mixed",
                    max_shots: int = 2) -> list[Pair]:
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(Path(model_dir))
    eos = tok.eos_token_id
    pairs = []
    for row in synth_rows(task, n, seed=seed, max_shots=max_shots):
        pairs.append(Pair(
            id=row["id"],
            prompt=tok.encode(row["prompt"]),
            chosen=tok.encode(row["chosen"], add_special_tokens=False) + [eos],
            rejected=tok.encode(row["rejected"], add_special_tokens=False) + [eos],
        ))
    return pairs


def uncached_copy(data: Path, out: Path) -> Path:
    """``data`` plus one pair under a fresh id: content no earlier run (of this session or
    another: the reference cache outlives them) has made DPO's reference for."""
    import uuid

    first = data.read_text().splitlines()[0].replace('"id": "', f'"id": "{uuid.uuid4().hex}-', 1)
    out.write_text(data.read_text() + first + "\n")
    return out


def write_reference_for(path: Path, key: str, data: Path, drop: int = 0) -> Path:
    """A reference file under ``key`` with made-up values for ``data``'s pair ids (all but
    the last ``drop``): what a user's --reference-logps may hold."""
    from engine.data.pairs import load_pairs
    from engine.train.reference_file import write_reference

    pairs = load_pairs(data)
    ids = [p.id for p in (*pairs.train, *pairs.valid, *pairs.test)]
    write_reference(path, key, {i: (-10.0, -11.0) for i in ids[: len(ids) - drop]})
    return path
