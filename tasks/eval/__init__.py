"""Evaluation: an adapter (or the base) on the held-out splits, scored generations, scorers,
small-sample intervals, the paired test against the base, and collapsed-run detection.
"""
