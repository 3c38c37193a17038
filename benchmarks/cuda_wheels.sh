#!/usr/bin/env bash
# MLX's CUDA build, packed to carry to a Linux GPU host that has Python 3.12 and CUDA 13 but
# no internet (what benchmarks/h200.sh and benchmarks/h200_checkpoints.sh source there):
#   bash benchmarks/cuda_wheels.sh        # here, once: mlx, mlx-cuda-13, mlx-lm into .whl/
#   source .whl/activate.sh               # there, first in each command: into /tmp/site
# A host with internet needs none of this: pip install "mlx[cuda13]==X" "mlx-lm==Y".
# The versions are the ones docs/performance.md's figures were measured with (override with
# the variables below). The wheels come to 87 MB (2026-12-06), nearly all of it mlx-cuda-13's
# kernels for every GPU generation.
set -euo pipefail
MLX_VERSION="${MLX_VERSION:-0.32.4}"
MLX_LM_VERSION="${MLX_LM_VERSION:-0.32.2}"
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/.whl"
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$out" "mlx==$MLX_VERSION" \
  "mlx-cuda-13==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION"
cat > "$out/activate.sh" <<'ACT'
# Sourced on the GPU host: MLX (CUDA) and mlx-lm from .whl/ into /tmp/site, once.
if [ ! -d /tmp/site/mlx ]; then
  rm -rf /tmp/site && mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
ACT
du -sh "$out"
