"""Pomona's tasks: plain functions for data, models, trials, evaluation and aggregation, the
Ray sweep, and the Prefect tasks that wrap them (pipeline_tasks.py, trial_task.py).
Imports point down only: tasks -> engine.
"""
