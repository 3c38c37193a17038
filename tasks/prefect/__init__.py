"""The Prefect tasks: thin typed wrappers over the plain functions of the wings below, one task
run per pipeline stage, per reference and per trial.
"""
