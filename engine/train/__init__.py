"""Training runs: the recipes (the lone run, a pack, GRPO, online pairs) and the parts they
share (run_parts.py), the one model set-up every path uses (prepared.py), a run's books
between its steps (run_books.py), probes of a step's cost, resuming, and DPO/KTO's reference
log-probs.
"""
