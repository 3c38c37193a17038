"""Training runs: the one model set-up every path uses (prepared.py), the training loop, probes
of a step's cost, resuming, the metrics between reports, and DPO/KTO's reference log-probs.
"""
