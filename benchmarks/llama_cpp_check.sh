#!/usr/bin/env bash
# llama.cpp's own check of `pomona export` (issue 55; docs/engine.md, "GGUF out"):
#   bash benchmarks/llama_cpp_check.sh [OUT_DIR] [TYPE]     (default runs/llama-cpp-check f32)
# 1. llama.cpp, built from PyPI's llama-cpp-python source into .venv-llama-cpp (cmake;
#    minutes on 2 cores the first time, then pip's cached wheel);
# 2. SmolLM2 (from PyPI) trained 16 ORPO steps, exported as a GGUF, and MLX's fused model's
#    answers on 8 prompts (the project's .venv, made by ./run);
# 3. llama.cpp's answers on the same prompts, compared: prompt tokens, 16 greedy tokens,
#    next-token logits. Exit 1 if they disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/llama-cpp-check}
TYPE=${2:-f32}
LLAMA_VENV=${LLAMA_VENV:-.venv-llama-cpp}
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"  # the llama.cpp this check was run with
./run lint >/dev/null  # makes .venv when it is missing
[ -x "$LLAMA_VENV/bin/python" ] || python3 -m venv "$LLAMA_VENV"
start=$(date +%s)
"$LLAMA_VENV/bin/python" -m pip install -q --disable-pip-version-check "$LLAMA_CPP_PYTHON"
echo "llama.cpp ($LLAMA_CPP_PYTHON) ready in $(( $(date +%s) - start )) s"
LD_PRELOAD=$(ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 2>/dev/null | head -1) \
  .venv/bin/python -m benchmarks.llama_cpp_check mlx --out "$OUT" --type "$TYPE"
"$LLAMA_VENV/bin/python" benchmarks/llama_cpp_check.py llama --out "$OUT"
