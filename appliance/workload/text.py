"""Deterministic chat text of a given length, so the prompts a benchmark sends are about the
token counts its workload says.

Model of the world: every word below is one token for the simulated engine's fallback
tokenizer (a space and a word) and one or two for the BPE vocabularies of common models,
so `n` words are about `n` tokens; the appliance's tokenizer decides the exact count. The
same key always gives the same text, and different keys diverge in the first words, so two
texts share cached blocks only when they are meant to (the same prefix id).
"""

from __future__ import annotations

import random

_VOCABULARY = """
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there one all we their has been if more when will would
who so no out up into do can time only other new some could these two may first then any
like my now over such our man me even most made after also did many before must through
back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life
being under never day same another know while last might us great old year off come since
against go came right used take three place file test line code value error result build
check list table data field name path text
"""
WORDS = tuple(_VOCABULARY.split())


def words(key: str, n_tokens: int) -> str:
    """About `n_tokens` tokens of text, the same for the same key."""
    rng = random.Random(key)
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens)))
