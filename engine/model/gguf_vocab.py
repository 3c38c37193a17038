"""The tokenizer an exported GGUF carries (``tokenizer.ggml.*`` and the chat template).

Copied from the source GGUF where the model came from one: the GGUF file itself, or the
``gguf_tokenizer.json`` its import keeps (engine/model/gguf_import.py), so llama.cpp reads
back exactly the vocabulary, pre-tokenizer and special tokens it was given. Otherwise
built from the model's ``tokenizer.json`` as llama.cpp's converter does for a byte-level
BPE (``_set_vocab_gpt2``): tokens by id, special added tokens as CONTROL, the list padded
to the embedding's rows, merges, special ids and the template through the gguf package's
``SpecialVocab``. Any other tokenizer kind is refused in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

SAVED = "gguf_tokenizer.json"  # beside an imported model: its source's tokenizer fields


def source_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """The fields of a GGUF's metadata an export copies: ``tokenizer.*``."""
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def saved_fields(model: Path) -> dict[str, Any] | None:
    """The source GGUF's tokenizer fields: read from ``model`` when it is a .gguf file,
    from its import's ``gguf_tokenizer.json`` when it is a folder that keeps one."""
    if model.is_file():
        import gguf

        fields = gguf.GGUFReader(str(model)).fields
        return {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
    path = model / SAVED
    return json.loads(path.read_text()) if path.is_file() else None


def write_fields(writer: Any, fields: dict[str, Any]) -> None:
    """Copied ``tokenizer.*`` fields, each in the value type llama.cpp reads it as."""
    lists = {"tokenizer.ggml.tokens": writer.add_token_list,
             "tokenizer.ggml.token_type": writer.add_token_types,
             "tokenizer.ggml.scores": writer.add_token_scores,
             "tokenizer.ggml.merges": writer.add_token_merges}
    for key, value in fields.items():
        if key in lists:
            lists[key](value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        # other arrays (llama.cpp reads none under tokenizer.* beyond the four above)


def write_bpe(writer: Any, model: Path, rows: int) -> None:
    """A byte-level BPE ``tokenizer.json`` written as llama.cpp's converter writes one,
    the token list padded to ``rows`` (the embedding's); ValueError for any other kind."""
    import gguf

    path = model / "tokenizer.json"
    try:
        tok = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; an export needs the model's "
                         "tokenizer.json (or a GGUF source to copy it from)") from None
    kind, decoder = tok["model"].get("type"), (tok.get("decoder") or {}).get("type")
    if kind != "BPE" or decoder != "ByteLevel" or tok["model"].get("byte_fallback"):
        raise ValueError(f"{path}: a {kind} tokenizer with a {decoder} decoder; the export "
                         "builds byte-level BPE only: export from the model's GGUF instead "
                         "(--model FILE.gguf), whose tokenizer it copies")
    ids = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    by_id = {i: t for t, i in ids.items()}
    if rows < len(by_id):
        raise ValueError(f"{path}: {len(by_id)} tokens, more than the embedding's {rows} rows")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(rows)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             if i in by_id else gguf.TokenType.UNUSED for i in range(rows)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    notices = logging.getLogger("gguf.vocab")
    notices.addFilter(_no_pair_notice)  # llama.cpp never encodes a pair: noise on the CLI
    try:
        special = gguf.SpecialVocab(model, load_merges=True, n_vocab=rows)
    finally:
        notices.removeFilter(_no_pair_notice)
    special.add_to_gguf(writer, quiet=True)


def _no_pair_notice(record: logging.LogRecord) -> bool:
    """Drop the gguf package's notice about a ``TemplateProcessing<pair>`` it cannot map
    (Llama's own "<s> $A <s> $B" draws it)."""
    return "TemplateProcessing<pair>" not in record.getMessage()
