"""Experiment tracking: a run's trials, evaluations, board and best adapter sent to the
trackers a lab already looks at (MLflow, TensorBoard, W&B offline), from the run's own
files, by the driver alone (tasks/track/tracker.py)."""
