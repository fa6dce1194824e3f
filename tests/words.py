"""Prompt text for the tests and benchmarks that drive a whole appliance: Greek-letter words,
each with a number drawn beside it, so the text of one seed shares no prefix with another's
and every caller controls its own cache hits."""

from __future__ import annotations

import random
from collections.abc import Sequence

GREEK = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
)


def numbered_words(
    rng: random.Random, n: int, *, letters: Sequence[str] = GREEK, numbers: int = 10000
) -> str:
    """`n` words, each a letter's name and a number below `numbers` ("kappa4821")."""
    return " ".join(f"{rng.choice(letters)}{rng.randrange(numbers)}" for _ in range(n))
