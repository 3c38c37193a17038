"""`pomona model init`: self-made models load and run through mlx-lm's own code paths."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from tasks.models.model_factory import IM_END, ModelSpec, init_model, train_tokenizer
from tests.conftest import TINY

pytestmark = pytest.mark.integration


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_loads_and_generates(tiny_model: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_model))
    names = {k for k, _ in tree_flatten(model.parameters())}
    assert "lm_head.weight" in names  # llama default: untied head
    assert len(model.layers) == TINY.layers
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Sort these numbers: 3 1 2"}], add_generation_prompt=True
    )
    text = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=8)
    assert isinstance(text, str) and text  # a random model still emits tokens
    logits = model(mx.array([prompt]))
    assert logits.shape == (1, len(prompt), TINY.vocab)
    assert logits.dtype == mx.float32 and bool(mx.all(mx.isfinite(logits)))


def test_tokenizer_special_tokens_and_template(tiny_model: Path) -> None:
    _, tokenizer = mlx_lm.load(str(tiny_model))
    assert tokenizer.eos_token == IM_END
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(IM_END)}
    ids = tokenizer.encode("hello")
    assert ids[0] == tokenizer.bos_token_id  # llama-style tokenizers prepend BOS
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200))
def test_any_text_round_trips(text: str) -> None:
    tok = _tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


_TOKENIZER = None


def _tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = train_tokenizer(TINY)
    return _TOKENIZER


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, tiny_model: Path) -> None:
    again = init_model(TINY, tmp_path / "again")
    assert _files(again) == _files(tiny_model)
    other = init_model(replace(TINY, seed=1), tmp_path / "other")
    a = mx.load(str(tiny_model / "model.safetensors"))
    b = mx.load(str(other / "model.safetensors"))
    assert a.keys() == b.keys()
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(np.array(a[w]), np.array(b[w]))
    assert (other / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()


def test_quantized_variant_loads_and_generates(tiny_model_q4: Path, tmp_path: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_model_q4))
    q_proj = model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == 4
    assert mlx_lm.generate(model, tokenizer, prompt="Add the two numbers:", max_tokens=4)
    again = init_model(replace(TINY, quantize=4), tmp_path / "q4")
    assert _files(again) == _files(tiny_model_q4)


def test_qwen2_variant(tiny_qwen2: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_qwen2))
    names = {k for k, _ in tree_flatten(model.parameters())}
    assert "lm_head.weight" not in names  # tied head
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert tokenizer.bos_token is None
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)
    assert mlx_lm.generate(model, tokenizer, prompt="hello", max_tokens=4)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"hidden": 60}, "hidden"),
        ({"kv_heads": 3}, "heads"),
        ({"vocab": 100}, "vocab"),
        ({"quantize": 3}, "quantize"),
        ({"quantize": 4, "hidden": 96}, "hidden"),
        ({"layers": 0}, "layers"),
        ({"arch": "qwen2", "window": 8}, "window=8: arch qwen2 has no use"),  # was ignored
        ({"experts": 4}, "experts=4: arch llama"),
        ({"window_pattern": 3}, "window_pattern=3 without a window"),
        ({"arch": "phi3", "ple": 8}, "ple=8"),
        ({"arch": "qwen3_moe", "experts_per_token": 5}, "experts_per_token=5"),
        ({"arch": "gemma4_text", "layers": 6}, "layer 5 .full_attention. shares K/V"),
    ],
)
def test_bad_spec_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        replace(ModelSpec(), **change).validate()


def test_refuses_to_overwrite(tiny_model: Path) -> None:
    with pytest.raises(FileExistsError, match="overwrite"):
        init_model(TINY, tiny_model)


def test_init_writes_through_a_symlink_to_an_empty_folder(tmp_path: Path) -> None:
    """Item 15: `model init --out LINK` (LINK -> an empty folder) was rmtree's OSError
    traceback ("Cannot call rmtree on a symbolic link"); `model import` said the folder
    "is not empty" (after the whole import). Now both write into the folder the link
    points to, and the link, the folder and its parent stay."""
    from typer.testing import CliRunner

    from cli.main import app
    from tests.test_gguf_import import llama_gguf

    for verb in ("init", "import"):
        target, link = tmp_path / f"{verb}-target", tmp_path / f"{verb}-link"
        target.mkdir()
        link.symlink_to(target)
        args = (["model", "init", "--layers", "1", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--intermediate", "128", "--vocab", "512"]
                if verb == "init" else
                ["model", "import", str(llama_gguf(tmp_path / "m.gguf")), "--dtype", "float32"])
        result = CliRunner().invoke(app, [*args, "--out", str(link)])
        assert result.exit_code == 0, (verb, result.output)
        assert link.is_symlink() and link.resolve() == target.resolve()
        assert (target / "config.json").is_file() and (target / "pomona_model.json").is_file()


def test_overwrite_keeps_a_users_readme(tmp_path: Path) -> None:
    """Low item: `model init --overwrite` deleted a README.md the user wrote into a Pomona
    model folder. Only Pomona's files are replaced; the README stays byte for byte."""
    spec = replace(TINY, layers=1)
    out = init_model(spec, tmp_path / "m")
    (out / "README.md").write_text("my notes")
    init_model(replace(spec, seed=1), out, overwrite=True)
    assert (out / "README.md").read_text() == "my notes"
    assert json_seed(out) == 1 and not list(tmp_path.glob(".m.*"))


def json_seed(out: Path) -> int:
    import json

    return json.loads((out / "pomona_model.json").read_text())["seed"]
