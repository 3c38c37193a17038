"""Pomona's training engine: pure MLX (mlx, mlx-lm, numpy, pyarrow, safetensors).

No Prefect, Ray or terminal UI here: progress leaves through callbacks, so
``python -m engine ...`` trains one adapter on its own.
"""
