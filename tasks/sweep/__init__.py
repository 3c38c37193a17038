"""The Ray sweep: a spec read (spec_file.py) and planned into one SweepPlan of typed trial
plans before anything runs, the references those plans need, each trial in its own actor (or
a gang of ranks), the scheduler that retries lost ones, memory probes and memory sweeps, and
Optuna's search.
"""
