"""Self-made models: random-init llama/qwen2 weights plus a locally trained tokenizer.

No hub is reachable from tests, CI or the demo, so Pomona builds its own small models in
the Hugging Face layout that ``mlx_lm.load(DIR)`` reads (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``). Loading them goes
through exactly the code a user's downloaded model takes. Same spec, same bytes.

    pomona model init --out models/tiny --layers 4 --hidden 128 --seed 0 [--quantize 4]
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tasks.synthetic import LAYOUTS, TASKS, synth_rows

ARCHS = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")
PAD, BOS, EOT = "<|pad|>", "<|bos|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOT, IM_START, IM_END]  # ids 0..4, in this order

# ChatML; BOS only where the tokenizer has one (llama here, not qwen2, as upstream).
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """What ``pomona model init`` builds. Defaults: a ~1M-parameter model that trains on CPU."""

    arch: str = "llama"  # llama (untied head, BOS) or qwen2 (tied head, qkv bias, no BOS)
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention, as in current llama/qwen models
    intermediate: int = 256
    vocab: int = 1024
    seed: int = 0
    dtype: str = "float32"  # CPU matmuls in bf16 skip BLAS and are slow: keep float32 there
    max_position: int = 4096
    tie_embeddings: bool | None = None  # None: the arch's usual choice
    quantize: int | None = None  # 4 or 8 bits, through mlx_lm.convert
    q_group_size: int = 64

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}: expected one of {', '.join(ARCHS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden={self.hidden} / heads={self.heads} gives head dim "
                             f"{self.hidden // self.heads}; rotary needs it even")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab={self.vocab}: byte-level BPE needs at least "
                             f"{256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)")
        if self.quantize not in (None, 4, 8):
            raise ValueError(f"quantize={self.quantize}: expected 4 or 8")
        if self.quantize and (self.hidden % self.q_group_size or
                              self.intermediate % self.q_group_size):
            raise ValueError(f"quantize needs hidden ({self.hidden}) and intermediate "
                             f"({self.intermediate}) to be multiples of q_group_size "
                             f"({self.q_group_size})")

    @property
    def tied(self) -> bool:
        return self.arch == "qwen2" if self.tie_embeddings is None else self.tie_embeddings


def tokenizer_corpus(rows_per_file: int = 200) -> list[str]:
    """Text the tokenizer is trained on: every synthetic task in every layout (seed 0)."""
    texts: list[str] = []
    for task in TASKS[:-1]:  # "mixed" repeats the others
        for layout in LAYOUTS:
            for row in synth_rows(task, rows_per_file, seed=0, layout=layout):
                texts.append(json.dumps(row, ensure_ascii=False))
    return texts


def train_tokenizer(spec: ModelSpec):
    """A byte-level BPE tokenizer (any text round-trips) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer)
    if spec.arch == "llama":  # llama tokenizers prepend BOS themselves
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(spec: ModelSpec) -> dict:
    """``tokenizer_config.json`` for transformers' fast tokenizer (what mlx-lm wraps)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS if spec.arch == "llama" else None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": spec.arch == "llama",
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(spec: ModelSpec) -> dict:
    """``config.json`` in the Hugging Face layout for ``spec.arch``."""
    common = {
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "intermediate_size": spec.intermediate,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tied,
        "torch_dtype": spec.dtype,
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }
    if spec.arch == "llama":
        return {**common, "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
                "bos_token_id": SPECIAL_TOKENS.index(BOS)}
    return {**common, "architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "use_sliding_window": False, "bos_token_id": None}


def init_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights for every parameter of the mlx-lm model ``config`` describes.

    N(0, 0.02) for block matrices (GPT-2's init), output projections scaled by
    1/sqrt(2·layers) so the residual stream stays O(1); embeddings and the head N(0, 1/H),
    so a frozen head can still express confident predictions (with 0.02 its logits are
    capped near ±2.5 at H=128, and LoRA on top cannot push the NLL down); norms 1, biases 0.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    del model
    mx.clear_cache()
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / np.sqrt(2.0 * config["num_hidden_layers"])
    weights = {}
    for name in sorted(shapes):  # fixed order: the same seed gives the same bytes
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            weights[name] = np.zeros(shape, np.float32)
        else:
            std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                std = 1.0 / np.sqrt(config["hidden_size"])
            weights[name] = rng.normal(0.0, std, size=shape).astype(np.float32)
    return weights


def _write_float_model(spec: ModelSpec, out: Path) -> None:
    import mlx.core as mx
    from mlx_lm.utils import save_config

    config = model_config(spec)
    weights = init_weights(config, spec.seed)
    dtype = getattr(mx, spec.dtype)
    arrays = {k: mx.array(v).astype(dtype) for k, v in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    save_config(config, config_path=out / "config.json")
    train_tokenizer(spec).save(str(out / "tokenizer.json"), pretty=True)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec), indent=2) + "\n")
    (out / "pomona_model.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")


def init_model(spec: ModelSpec, out: Path | str, overwrite: bool = False) -> Path:
    """Write the model ``spec`` describes to ``out`` (atomically); return ``out``.

    With ``spec.quantize`` the float model is written first and handed to
    ``mlx_lm.convert`` — the exact path a user's quantized model takes.
    """
    spec.validate()
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True "
                              "(CLI: --overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        stage = Path(tmp) / "model"
        if spec.quantize:
            from mlx_lm.convert import convert

            _write_float_model(spec, Path(tmp) / "float")
            with contextlib.redirect_stdout(io.StringIO()):  # convert prints [INFO] lines
                convert(str(Path(tmp) / "float"), str(stage), quantize=True,
                        q_bits=spec.quantize, q_group_size=spec.q_group_size)
            shutil.copy(Path(tmp) / "float" / "pomona_model.json", stage)
        else:
            _write_float_model(spec, stage)
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    return out
