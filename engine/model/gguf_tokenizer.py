"""A GGUF's tokenizer, rebuilt from its ``tokenizer.ggml.*`` metadata by transformers' own
GGUF builders (which need ``tokenizers`` only, never torch), saved beside the import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A transformers fast tokenizer from ``tokenizer.ggml.*`` (transformers' own builders,
    which stay clear of torch), with the file's special tokens, BOS flag and chat template."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gtm

    fields = gtm.GGUF_TOKENIZER_MAPPING["tokenizer"]
    td = {name: meta[f"tokenizer.{key}"] for key, name in fields.items()
          if f"tokenizer.{key}" in meta}
    built = gtm.select_tokenizer_builder(meta["general.architecture"], td.get("tokenizer_type"))
    tok = gtm.set_split_regex(gtm.add_gguf_special_tokens(built(td), td), td)
    tokens = td["tokens"]

    def special(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    # BOS as transformers' own GGUF loader decides it (tests/golden): the file's flag, on by
    # default for a sentencepiece vocabulary, off for Gemma 4 (its template writes <bos>).
    kind = td.get("tokenizer_type")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and kind != "gemma4"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"), unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"), chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(add_bos),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))

def fix_tokenizer_class(stage: Path) -> None:
    """Name the generic fast class (older transformers know no ``TokenizersBackend``)."""
    config_path = stage / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
