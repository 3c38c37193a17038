"""Every family Pomona supports, every lever, against autograd over the model's own call.

For each architecture ``pomona model init --arch`` builds (tiny, float32, CPU), the
engine's loss and every LoRA gradient are compared with ``nn.value_and_grad`` over the
model's own ``__call__`` (two forwards, dense logits) on the same token ids, at sequences
of at least 3× the model's sliding window, through: segment sizes 1, 2, 3 and one that
puts a shared-K/V donor and its consumers in different segments; the bounded head on and
off; prefix sharing off, split and mask (two ragged rows each).

Tolerance: max |g − g_ref| ≤ 1e-5 · max |g_ref| per tensor, loss and metrics to 1e-5
relative (float32; the paths reorder attention and logsumexp sums only).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from engine.backward import segmented
from engine.backward.segmented import plain_value_and_grad, value_and_grad
from engine.check.load_check import check_length, check_stack, checked_stack
from engine.data.batch import batch_norms, make_batch
from engine.forward.prefix import split_prefix_batch
from engine.losses import LossSpec, pair_loss, spec_of
from engine.model.arch import make_stack
from engine.model.arch.stack import Stack
from engine.model.load import lora_modules
from tasks.models.model_factory import init_model
from tests.family_specs import BASE, MOE, SPECS, WINDOW, family_pairs
from tests.parity import assert_same, with_lora

pytestmark = [pytest.mark.integration, pytest.mark.long]  # conftest.py: scheduled first

@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = init_model({**SPECS, **MOE}[name], root / name)
        return built[name]

    return get


def lora_family(path: Path, keys: tuple[str, ...] | None = None):
    """The model with LoRA (non-zero B, so A gets gradients too) and its checked stack."""
    model, _ = mlx_lm.load(str(path))
    return with_lora(model, keys), checked_stack(model)[0]


def loss_fn(batch, spec: LossSpec):
    norms = batch_norms([batch])
    resp, nll = mx.array(batch.resp_mask), mx.array(batch.nll_mask)
    return lambda lp: pair_loss(lp, resp, nll, spec, norms)


def reference(model, stack, pairs, spec):
    """nn.value_and_grad over model(tokens): two right-padded forwards, dense logits."""
    two = make_batch(pairs, spec.nll_span)
    return plain_value_and_grad(model, stack, two, loss_fn(two, spec))


def engine_paths(stack: Stack) -> list[int]:
    """Segment sizes 1, 2, 3 and, with shared K/V, the largest size that still puts a
    donor and one of its consumers in different segments (gemma4 tiny: 11, so donor 7 and
    its consumers share a segment while donor 5 hands its K/V to layer 11's)."""
    n = len(stack.layers)
    apart = [k for k in range(2, n)
             if any(d // k != c // k for c, d in stack.donor_of.items())]
    return sorted({1, 2, 3, *apart[-1:]})


# For a feature inside a layer (chunked MLPs, experts, blocked attention): the plain path
# and segments of 2, which put every gemma4 tiny donor apart from a consumer.
INNER = (2,)


def check_family(model, stack, spec: LossSpec, sizes: tuple[int, ...] | None = None) -> int:
    """All paths (segment ``sizes``, by default ``engine_paths``) against the reference, on
    each layout, with and without the bounded head; returns how many were compared."""
    runs = 0
    for layout, pairs in (("off", family_pairs(2, 1)), ("mask", family_pairs(2, 1)),
                          ("split", family_pairs(2, 2))):
        assert min(len(p.prompt) + len(p.rejected) for p in pairs) >= 3 * WINDOW
        ref = reference(model, stack, pairs, spec)
        # split, pad 16: prompts of 40 and 45 share 32 tokens; their tails run in both
        batch = (make_batch(pairs, spec.nll_span) if layout == "off" else
                 split_prefix_batch(pairs, spec.nll_span, attention=layout,
                                    pad_multiple=16 if layout == "split" else 0))
        pb = batch if layout == "off" else batch.pairs
        for k in [0, *(engine_paths(stack) if sizes is None else sizes)]:
            for chunk in (0, 16):
                if k == 0 and chunk == 0 and layout == "off":
                    continue  # that is the reference itself
                got = value_and_grad(model, stack, batch, loss_fn(pb, spec), k, chunk)
                assert_same(got, ref)
                runs += 1
    return runs


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_every_lever_equals_autograd_over_the_model(arch: str, family_dir) -> None:
    """Each family, each path: catches a dropped sliding window (a layer on full causal
    attention), a missing embedding/logit scale or softcap, a lost per-layer input, a
    donor's K/V cotangent dropped or not summed over its consumers, a rejected token's
    window or query scale counted in concatenation positions, a LoRA gradient missing."""
    model, stack = lora_family(family_dir(arch))
    assert stack.model_type == SPECS[arch].arch
    assert check_length(stack) > max(stack.windows, default=0)
    runs = check_family(model, stack, spec_of("orpo", "full", orpo_lambda=0.5))
    assert runs >= 3 * (2 * 4 - 1)


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_and_multimodal_checkpoints_train_exactly(arch: str, family_dir) -> None:
    """Experts (routed top-k) and a multimodal Gemma 4 (its text decoder): exact on every
    lever; experts and routers take no LoRA by default, and do when asked."""
    model, stack = lora_family(family_dir(arch))
    names = [n for n, _ in lora_modules(model)]
    assert names and not any("switch" in n or "router" in n or n.endswith("mlp.gate")
                             for n in names)
    check_family(model, stack, spec_of("orpo", "response", orpo_lambda=0.5), INNER)
    if arch == "qwen3_moe":  # experts adapted on request: LoRASwitchLinear, still exact
        keys = ("self_attn.q_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj")
        model, stack = lora_family(family_dir(arch), keys)
        assert any("switch_mlp" in n for n, _ in lora_modules(model))
        pairs = family_pairs(2, 3)
        spec = spec_of("orpo", "full", orpo_lambda=0.5)
        ref = reference(model, stack, pairs, spec)
        batch = make_batch(pairs, "full")
        for k in (1, 2):
            assert_same(value_and_grad(model, stack, batch, loss_fn(batch, spec), k, 16), ref)


def _parity_fails(model, stack) -> bool:
    try:
        check_family(model, stack, spec_of("orpo", "full", orpo_lambda=0.5))
    except AssertionError:
        return True
    return False


def test_a_dropped_window_fails_parity_and_the_load_check(family_dir, monkeypatch) -> None:
    """The mistake main made on llama sliding layers: full causal attention everywhere."""
    model, stack = lora_family(family_dir("llama"))
    monkeypatch.setattr(Stack, "window", lambda self, i: None)
    assert _parity_fails(model, stack)
    with pytest.raises(ValueError, match="differs from the model's own"):
        check_stack(model, make_stack(model))


def test_a_lost_donor_cotangent_fails_parity(family_dir, monkeypatch) -> None:
    """Consumers' K/V cotangents that never reach the donor's segment (or are not summed
    over consumers in several segments) change the donors' k/v LoRA gradients."""
    model, stack = lora_family(family_dir("gemma4_text"))
    assert stack.donor_of == {8: 7, 9: 7, 10: 7, 11: 5}
    donor_grads = [n for n, _ in lora_modules(model) if ".layers.7.self_attn.v_proj" in n]
    assert donor_grads
    monkeypatch.setattr(segmented, "_add_state", lambda acc, more: acc.update(more))
    assert _parity_fails(model, stack)  # the last consumer's cotangent wins, not the sum
    monkeypatch.setattr(segmented, "_add_state", lambda acc, more: acc.update(
        {d: tuple(mx.zeros_like(a) for a in cot) for d, cot in more.items()}))
    assert _parity_fails(model, stack)  # cotangents zeroed on the way
    monkeypatch.setattr(segmented, "_add_state", lambda acc, more: None)
    with pytest.raises(KeyError):  # and a dropped one is never silently zero
        check_stack(model, stack)


def test_gemma4_per_layer_inputs_and_softcap_matter(family_dir, monkeypatch) -> None:
    """Without PLE or the softcap the stack is not the model: the load check refuses."""
    from engine.model.arch.gemma4 import Gemma4

    model, _ = lora_family(family_dir("gemma4_text"))
    monkeypatch.setattr(Gemma4, "side", Stack.side)
    with pytest.raises(ValueError, match="differs"):
        check_stack(model, make_stack(model))
    monkeypatch.undo()
    monkeypatch.setattr(Gemma4, "project", lambda self, h: self.inner.embed_tokens.as_linear(h))
    with pytest.raises(ValueError, match="differs"):
        check_stack(model, make_stack(model))


def test_rejected_positions_matter_in_shared_layouts(family_dir, monkeypatch) -> None:
    """Ministral 3's query scale and a sliding window read logical positions: counting a
    rejected token at its concatenation index breaks parity."""
    from engine.forward import prefix_patch

    model, stack = lora_family(family_dir("ministral3"))
    monkeypatch.setattr(prefix_patch, "logical_positions",
                        lambda b: np.broadcast_to(np.arange(b.inputs.shape[1], dtype=np.int32),
                                                  b.inputs.shape).copy())
    assert _parity_fails(model, stack)


def test_unlisted_architectures_are_checked_or_refused(tmp_path: Path) -> None:
    """An unlisted model_type trains only if the llama-like stack reproduces it; granite's
    embedding/residual/logit multipliers do not, and the refusal lists what is supported."""
    from mlx_lm.models import granite

    args = granite.ModelArgs(model_type="granite", hidden_size=64, num_hidden_layers=2,
                             intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                             vocab_size=512, logits_scaling=4.0, attention_multiplier=0.1,
                             embedding_multiplier=6.0, residual_multiplier=0.3,
                             max_position_embeddings=512, num_key_value_heads=2,
                             attention_bias=False, mlp_bias=False, rope_theta=10000.0)
    model = granite.Model(args)
    with pytest.raises(ValueError, match=r"no Pomona adapter.*supported: gemma3_text"):
        checked_stack(model)


def test_adapters_load_and_generate_in_mlx_lm(family_dir, tmp_path: Path) -> None:
    """A gemma4 adapter trained by the engine loads with mlx_lm.load(adapter_path=) and
    generates; its config names the family's targets (no per-layer-input gates)."""
    import json

    from engine.data.pairs import write_pairs_jsonl
    from engine.settings.config import TrainConfig
    from engine.train.trainer import train

    path = family_dir("gemma4_text")
    data = write_pairs_jsonl(family_pairs(8, 5), tmp_path / "pairs.jsonl", split="train")
    out = tmp_path / "run"
    train(TrainConfig(model=str(path), data=str(data), out=str(out), steps=2, batch_size=2,
                      segment_size=2, head_chunk=16, val_every=0, learning_rate=1e-3,
                      verify=True))
    keys = json.loads((out / "adapter_config.json").read_text())["lora_parameters"]["keys"]
    assert "self_attn.k_proj" in keys and not any(k.startswith("per_layer") for k in keys)
    import mlx.core as mx

    model, tok = mlx_lm.load(str(path), adapter_path=str(out))
    assert isinstance(mlx_lm.generate(model, tok, prompt=tok.encode("hi"), max_tokens=3), str)
    base, _ = mlx_lm.load(str(path))
    tokens = mx.array([tok.encode("hi there")])
    assert float(mx.abs(model(tokens) - base(tokens)).max()) > 1e-5  # the trained LoRA acts


def test_blocked_full_layers_stay_exact(family_dir, monkeypatch) -> None:
    """Full layers attending in recomputed query blocks (what a GPU does for Gemma 4's
    512-wide global heads at long lengths), and sliding layers in window blocks, forced
    here on CPU at short ones: every lever still equals autograd."""
    from engine.model import attention

    monkeypatch.setattr(attention, "WHOLE_SCORES_BYTES", 0)  # the tiny scores fit
    monkeypatch.setattr(attention, "full_block", lambda q: 16 if q.shape[2] > 16 else 0)
    model, stack = lora_family(family_dir("gemma4_text"))
    assert check_family(model, stack, spec_of("orpo", "full", orpo_lambda=0.5), INNER) > 0


@pytest.mark.parametrize("arch", ["gemma4_text", "llama", "qwen3_moe", "phi3"])
def test_chunked_recomputed_mlps_stay_exact(arch: str, family_dir) -> None:
    """MLPs on 16-token chunks, recomputed in the backward (``mlp_chunk``), with LoRA on
    their projections: catches a LoRA gradient that stops at the chunk (parameters
    captured as constants) or a chunk that drops rows."""
    from engine.model.recompute import chunk_mlps

    keys = (("self_attn.q_proj", "mlp.gate", "mlp.switch_mlp.up_proj")  # router, experts
            if arch == "qwen3_moe" else None)
    model, stack = lora_family(family_dir(arch), keys)
    assert any(".mlp." in n for n, _ in lora_modules(model))
    chunk_mlps(stack.layers, 16)
    assert check_family(model, stack, spec_of("orpo", "full", orpo_lambda=0.5), INNER) > 0


def _olmo3(window: int = WINDOW):
    """An unlisted family with sliding layers from its config's ``layer_types`` (mlx-lm's
    olmo3: three sliding layers to one full), LoRA attached as in training."""
    from mlx_lm.models import olmo3

    args = olmo3.ModelArgs(model_type="olmo3", hidden_size=64, num_hidden_layers=4,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=BASE.vocab, max_position_embeddings=4096,
                           sliding_window=window, rope_theta=10000.0, num_key_value_heads=2)
    model = olmo3.Model(args)
    model.set_dtype(mx.float32)
    return with_lora(model)


def test_an_unlisted_windowed_family_is_exact_through_the_generic_stack() -> None:
    """olmo3 is not listed: the llama-like Stack reads its windows from ``layer_types``
    and passes the check, and every lever is then exact on it."""
    model = _olmo3()
    stack, _ = checked_stack(model)
    assert not stack.listed and stack.windows == [WINDOW]
    assert check_family(model, stack, spec_of("orpo", "full", orpo_lambda=0.5)) > 0


def test_an_unlisted_window_the_stack_misses_is_refused(monkeypatch) -> None:
    """The review's olmo3 case: a Stack blind to the window passed a 64-token check with
    window 64, then trained every layer on full attention. The check now runs past every
    window an unlisted config declares, so the blind Stack is refused, with the list."""
    monkeypatch.setattr(Stack, "window", lambda self, i: None)
    model = _olmo3(window=64)
    with pytest.raises(ValueError, match=r"no Pomona adapter.*supported: gemma3_text"):
        checked_stack(model)
