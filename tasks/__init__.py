"""Pomona's tasks: plain functions for data, models, trials, evaluation and aggregation,
with thin Prefect task wrappers. Imports point down only: tasks -> engine.
"""
