"""Pomona's tasks: plain functions for data, models, trials, evaluation and aggregation, the
Ray sweep, and the Prefect tasks that wrap them. Its wings, lowest floor first: data/,
models/, nodes/, eval/, board/, sweep/, prefect/ (tasks/prefect/pipeline_tasks.py,
tasks/prefect/trial_task.py); a wing imports only the wings before it. Imports point down
only: tasks -> engine.
"""
