"""Forward-only paths over a model's stack: the prefix-shared layouts and their patching of
mlx-lm's model, the layout each batch takes on this device, scoring (validation metrics,
per-pair scores, the KL point) and batched greedy generation.
"""
