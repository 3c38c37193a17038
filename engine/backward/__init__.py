"""Gradients and updates: the segmented (or plain) value and grad of one micro-batch, one
optimizer step over its micro-batches and ranks, the optimizer's update, and data parallel
over ``mx.distributed``.
"""
