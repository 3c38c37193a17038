"""The Ray sweep: a spec into typed trial plans, each trial in its own actor (or a gang of
ranks), the scheduler that retries lost ones, memory probes and memory sweeps, and Optuna's
search.
"""
