"""Preference data: files read into validated rows, rendered and tokenized into a dataset
directory, preprocessed (prefix, de-duplication, splits), and the synthetic tasks.
"""
