"""The three splits' shares: their defaults and the check every entry point applies.

Standard library only, so a command line that shows these defaults in its help loads no
MLX. Which row lands in which split is engine/data/pairs.py's ``stable_split``.
"""

from __future__ import annotations

VALID_FRACTION = 0.1
TEST_FRACTION = 0.1
MAX_BAD_FRACTION = 0.05  # share of unusable rows past which loading (and tokenizing) fails


def check_fractions(valid_fraction: float, test_fraction: float) -> None:
    """Raise ValueError unless both shares lie in [0, 1] and leave room for train."""
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value <= 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be between 0 and 1")
    if valid_fraction + test_fraction >= 1:
        raise ValueError(f"--valid-fraction {valid_fraction} + --test-fraction {test_fraction}"
                         " is 1 or more: nothing would be left to train on")
