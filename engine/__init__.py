"""Pomona's training engine: pure MLX (mlx, mlx-lm, numpy, pyarrow, safetensors, gguf).

No Prefect, Ray or terminal UI here: progress leaves through callbacks, so
``python -m engine ...`` trains one adapter on its own. Its wings, lowest floor first:
host/, losses/, settings/, model/, data/, forward/, backward/, check/, train/; a wing imports
only the wings before it, and cli.py stands on all of them (docs/engine.md).
"""

import os

# float32 matmuls in full float32, as torch does by default: MLX runs them as TF32 on CUDA
# (and M5-class Macs) unless told otherwise, which the load check cannot judge by (an E4B
# check: 0.265 with TF32, 1.9e-3 without). MLX reads this once, at its first float32
# matmul; bf16 and quantized matmuls are unaffected. A user's own setting wins.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
