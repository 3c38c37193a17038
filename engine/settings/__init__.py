"""The run's settings: ``TrainConfig`` (every knob, valid by construction), which reference a
loss compares against, and which metric value is better. Reads the losses only.
"""
