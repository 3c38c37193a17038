"""The load check and ``--verify``: a family's stack against the model's own logits and
gradients, and the configured path against the plain one, on a float32 copy.
"""
