"""Rewards the GRPO tests train on (``python:tests.grpo_rewards:NAME``): verifiers a random
tiny model's completions already differ on, so a group carries signal from step 1."""

from __future__ import annotations

from typing import Any


def digits(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """The share of the completion's characters that are digits."""
    text = completion.replace(" ", "")
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def broken(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """A verifier with a bug: it fails on every row."""
    raise KeyError("answer")
