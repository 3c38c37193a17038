"""Tokenized pairs: reading a dataset directory, its splits, its ids checked against the
model's vocabulary and tokenizer, and pairs padded into batches.
"""
