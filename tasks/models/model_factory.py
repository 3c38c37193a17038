"""Self-made models: random-init weights of each supported family plus a local tokenizer.

No hub is reachable from tests, CI or the demo, so Pomona builds its own small models in
the Hugging Face layout that ``mlx_lm.load(DIR)`` reads (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``). Loading them goes
through exactly the code a user's downloaded model takes. Same spec, same bytes.

    pomona model init --out models/tiny --arch gemma4_text --layers 12 --seed 0 [--quantize 4]

Each family's ``config.json`` and facts come from ``tasks/models/model_families.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np

from engine.host.outputs import RefusedOutput, entries
from engine.host.scratch import work_folder
from engine.model.gguf_check import expected_shapes
from tasks.data.synthetic import synth_rows
from tasks.models.model_families import BOS, FAMILIES, IM_END, PAD, SPECIAL_TOKENS, ModelSpec

MARK = "pomona_model.json"  # the spec a model was made from: what makes it Pomona's
# Everything a model of ours holds (mlx_lm.convert adds the last three when quantizing).
MODEL_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json",
                         "tokenizer_config.json", MARK, "model.safetensors.index.json",
                         "chat_template.jinja", "README.md"})
UNIT_GAINS = ("layer_scalar", "router.scale", "per_expert_scale")  # scalar gains start at 1
QK_NORMS = ("q_norm.weight", "k_norm.weight")

# ChatML; BOS only where the tokenizer has one (llama here, not qwen2, as upstream).
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The tasks whose text the tiny tokenizer learns: those it was first trained on (a new task
# in the corpus would change every tiny model's bytes, so every cache key made from one).
CORPUS_TASKS = ("sort", "reverse", "add")
CORPUS_LAYOUTS = ("explicit", "conversational", "implicit")  # the pair layouts, as ever


def tokenizer_corpus(rows_per_file: int = 200) -> list[str]:
    """Text the tokenizer is trained on: CORPUS_TASKS in each pair layout (seed 0)."""
    texts: list[str] = []
    for task in CORPUS_TASKS:
        for layout in CORPUS_LAYOUTS:
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
    if spec.bos:  # llama-style tokenizers prepend BOS themselves
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
        "bos_token": BOS if spec.bos else None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": spec.bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position,
        "chat_template": CHAT_TEMPLATE,
    }


def init_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights for every parameter of the mlx-lm model ``config`` describes.

    N(0, 0.02) for block matrices (GPT-2's init), output projections scaled by
    1/sqrt(2·layers) so the residual stream stays O(1); embeddings and the head N(0, 1/H),
    so a frozen head can still express confident predictions (with 0.02 its logits are
    capped near ±2.5 at H=128, and LoRA on top cannot push the NLL down); norms 1 (0 where
    the family scales by 1 + w; d^-1/4 for the q/k norms of an attention without 1/√d, whose
    saturated softmax would otherwise amplify float32 rounding ~50× over 12 layers), scalar
    gains 1, biases 0.
    """
    shapes = expected_shapes(config)
    text = config.get("text_config", config)  # a multimodal checkpoint's decoder sizes
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / np.sqrt(2.0 * text["num_hidden_layers"])
    family = FAMILIES[config["model_type"]]
    norm_value = 0.0 if family.offset_norms else 1.0  # (1 + w) norms start at 0
    weights = {}
    for name in sorted(shapes):  # fixed order: the same seed gives the same bytes
        shape = shapes[name]
        if family.unscaled_attention and name.endswith(QK_NORMS):
            # No 1/√d in the attention: q/k norm gains d^-1/4 give q·k that variance.
            weights[name] = np.full(shape, shape[-1] ** -0.25, np.float32)
        elif name.endswith("norm.weight"):
            weights[name] = np.full(shape, norm_value, np.float32)
        elif name.endswith(UNIT_GAINS):
            weights[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            weights[name] = np.zeros(shape, np.float32)
        else:
            std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                std = 1.0 / np.sqrt(text["hidden_size"])
            weights[name] = rng.normal(0.0, std, size=shape).astype(np.float32)
    if config["model_type"] == "gemma4":  # towers a real checkpoint carries; load drops them
        for tower in ("vision_tower", "audio_tower"):
            weights[f"model.{tower}.proj.weight"] = rng.normal(0, 0.02, (16, 16)).astype(
                np.float32)
    return weights


def _write_float_model(spec: ModelSpec, out: Path) -> None:
    import mlx.core as mx
    from mlx_lm.utils import save_config

    config = spec.config()
    weights = init_weights(config, spec.seed)
    dtype = getattr(mx, spec.dtype)
    arrays = {k: mx.array(v).astype(dtype) for k, v in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    save_config(config, config_path=out / "config.json")
    train_tokenizer(spec).save(str(out / "tokenizer.json"), pretty=True)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec), indent=2) + "\n")
    (out / MARK).write_text(json.dumps(asdict(spec), indent=2) + "\n")


def check_replaceable(out: Path) -> None:
    """Raise RefusedOutput unless ``out`` is a model Pomona made (its mark:
    ``pomona_model.json``) holding nothing but a model's files: replacing it deletes all."""
    if not out.is_dir() or out.is_symlink():
        raise RefusedOutput(f"--out {out}: exists and is not a folder; refusing to replace "
                            "it. Choose another --out")
    if not (out / MARK).is_file():
        raise RefusedOutput(f"--out {out}: not a model Pomona made (no {MARK}); refusing to "
                            "replace it, even with --overwrite. Choose another --out")
    if other := [n for n in entries(out) if n not in MODEL_FILES]:
        raise RefusedOutput(f"--out {out}: a Pomona model that also holds "
                            f"{', '.join(other[:3])}{' …' if len(other) > 3 else ''}; refusing "
                            "to delete them. Move them out or choose another --out")


def init_model(spec: ModelSpec, out: Path | str, overwrite: bool = False) -> Path:
    """Write the model ``spec`` describes to ``out``; return ``out``.

    With ``spec.quantize`` the float model is written first and handed to
    ``mlx_lm.convert`` — the exact path a user's quantized model takes. ``overwrite``
    replaces a model Pomona made, never another folder (``check_replaceable``), and only the
    files Pomona writes: a README.md already there is kept. A symlink to a folder is
    written through: the model lands in the folder it points to, the link stays.
    """
    spec.validate()
    out = Path(out)
    folder = out.resolve() if out.is_symlink() and out.is_dir() else out
    if out.is_symlink() and not out.is_dir():
        raise RefusedOutput(f"--out {out}: a symlink to {os.readlink(out)}, which is not a "
                            "folder; point it at a folder or choose another --out")
    replacing = folder.exists() and not (folder.is_dir() and not entries(folder))
    if replacing:
        if not overwrite:
            raise FileExistsError(f"--out {out}: holds files ({', '.join(entries(folder)[:3])}"
                                  "); pass --overwrite to replace a model Pomona made there")
        check_replaceable(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with work_folder(folder.parent, folder.name) as tmp:  # a killed init's is removed
        stage = Path(tmp) / "model"
        if spec.quantize:
            from mlx_lm.convert import convert

            _write_float_model(spec, Path(tmp) / "float")
            with contextlib.redirect_stdout(io.StringIO()):  # convert prints [INFO] lines
                convert(str(Path(tmp) / "float"), str(stage), quantize=True,
                        q_bits=spec.quantize, q_group_size=spec.q_group_size)
            shutil.copy(Path(tmp) / "float" / MARK, stage)
        else:
            _write_float_model(spec, stage)
        if replacing:
            _replace_files(stage, folder)
        else:
            if folder.exists():
                shutil.rmtree(folder)  # a real folder holding OS litter at most (entries)
            stage.rename(folder)
    return out


def _replace_files(stage: Path, folder: Path) -> None:
    """Move the new model's files over the old model's in ``folder`` one by one (each an
    atomic rename), the mark last; drop the old model's files the new one lacks. A
    README.md already there is the user's (or an earlier convert's): kept as it is."""
    keep = {"README.md"} & set(entries(folder))
    new = [n for n in entries(stage) if n not in keep]
    for name in sorted(new, key=lambda n: n == MARK):
        os.replace(stage / name, folder / name)
    for name in entries(folder):
        if name in MODEL_FILES and name not in new and name not in keep:
            (folder / name).unlink()
