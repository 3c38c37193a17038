"""How preference files become token ids: ``TokenizeOptions``, whose fields (with their help)
are what ``pomona data tokenize`` offers and what a dataset's fingerprint holds.

Light on purpose (no MLX, no pyarrow): the command line builds its options from these
fields while ``--help`` stays fast. The tokenizing itself is tasks/data/tokenize.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.data.splits import MAX_BAD_FRACTION, TEST_FRACTION, VALID_FRACTION, check_fractions
from tasks.data.preference_rows import LAYOUTS


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TokenizeOptions:
    """How files become token ids."""

    layout: str | None = _opt(None, f"{' | '.join(LAYOUTS)} (default: detect per file).")
    chat_template: str = _opt("auto", "auto (use it when the tokenizer has one) | on | off.")
    max_length: int | None = _opt(None, "Max prompt+response tokens per branch; default: the "
                                        "model's context length (config.json); 0 = none.")
    max_prompt_length: int = _opt(0, "Max prompt tokens; 0 = none.")
    valid_fraction: float = _opt(VALID_FRACTION, "Share of ids in valid (what training "
                                                 "reports and sweeps rank on).")
    test_fraction: float = _opt(TEST_FRACTION, "Share of ids in test (what the leaderboard "
                                               "reports; never ranked on).")
    # The limit loading pre-tokenized data applies, too.
    max_bad_fraction: float = _opt(MAX_BAD_FRACTION, "Fail above this share of bad rows.")
    batch_rows: int = _opt(1024, "Rows read and tokenized per batch.")

    def check(self) -> None:
        """Raise ValueError naming the first option out of range."""
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"--layout {self.layout!r}: expected one of {', '.join(LAYOUTS)}")
        if self.chat_template not in ("auto", "on", "off"):
            raise ValueError(f"--chat-template {self.chat_template!r}: expected auto, on or off")
        for name in ("max_length", "max_prompt_length"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be "
                                 "0 (no limit) or more")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"--max-bad-fraction {self.max_bad_fraction}: must be between "
                             "0 and 1")
        check_fractions(self.valid_fraction, self.test_fraction)
