"""Token ids of a rendered chat, tokenising only what a turn appended.

`encode_chat_text` turns a rendered chat into token ids reusing the previous turn's
`ChatTokens`, for tokenizers that declare `split_before` (strings before which their
`encode` cuts the text and tokenises each piece on its own). The text up to the last such
cut that the new text shares is not tokenised again, and the ids are the ones a whole
`encode` gives; `ChatEncoder` also remembers long pieces across sessions. A tokenizer
without the declaration is always tokenised whole.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

TokenIds = array
"""Token ids as machine integers (`array('q')`): one object to Python's cyclic collector,
where a tuple or list of ints has every item visited each time a collection meets it (tens
of microseconds per 8k-token prompt); also a quarter of the memory, compared by memcmp."""


def token_ids(ids: Sequence[int]) -> TokenIds:
    """`ids` as TokenIds, without a copy when they already are."""
    return ids if isinstance(ids, array) else array("q", ids)


@dataclass(frozen=True, slots=True)
class ChatTokens:
    """A rendered chat and its token ids, with `cuts`: (text offset, token offset) of each
    place where the tokenizer's `split_before` strings cut the text, in order."""

    text: str
    ids: TokenIds
    cuts: tuple[tuple[int, int], ...]
    stem: int = 0
    """Leading tokens that render the chat's system messages and tool schemas, which every
    session of its agent shares (0: unknown); see `with_stem`."""


def with_stem(chat: ChatTokens, stem_text: str) -> ChatTokens:
    """`chat` knowing its stem: `stem_text` is the chat's leading system messages and tools
    rendered alone; the stem ends at the last cut within the text both share, where the ids
    before it are exactly those of the stem's text."""
    lo, hi = 0, min(len(stem_text), len(chat.text))
    while lo < hi:  # the longest prefix of `stem_text` that the chat's text starts with
        mid = (lo + hi + 1) // 2
        if chat.text.startswith(stem_text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    stem = max((ids for offset, ids in chat.cuts if offset <= lo), default=0)
    return replace(chat, stem=stem)


def encode_chat_text(
    text: str,
    encode: Callable[[str], Sequence[int]],
    split_before: Sequence[str],
    previous: ChatTokens | None = None,
) -> ChatTokens:
    """`encode(text)`, for a tokenizer with `encode(a + b) == encode(a) + encode(b)` whenever
    `b` starts with one of `split_before`: tokenises only what follows the last cut of
    `previous` that `text` shares, piece by piece, recording the cuts for the next turn."""
    splitter = _splitter(tuple(split_before))
    ids = token_ids(())
    cuts: list[tuple[int, int]] = []
    start = stem = 0
    if previous is not None:
        shared = _shared_cut(previous, text, splitter)
        if shared is not None:
            start, n_ids = previous.cuts[shared]
            ids = previous.ids[:n_ids]
            cuts = list(previous.cuts[:shared])
            stem = previous.stem if previous.stem <= n_ids else 0  # the stem is still there
    bounds = [start, *(m.start() for m in splitter.finditer(text, start) if m.start() > start)]
    for a, b in zip(bounds, [*bounds[1:], len(text)], strict=True):
        cuts.append((a, len(ids)))
        if b > a:
            ids.extend(encode(text[a:b]))
    return ChatTokens(text, ids, tuple(cuts), stem)


class ChatEncoder:
    """`encode_chat_text` for one tokenizer, remembering the ids of long pieces (a system
    prompt or context that many sessions share) so that a new session's first turn does
    not tokenise them again. Bounded: the least recently used piece goes first."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        split_before: Sequence[str],
        *,
        min_chars: int = 2048,
        max_pieces: int = 256,
    ) -> None:
        self._encode = encode
        self.split_before = tuple(split_before)
        self._min_chars = min_chars
        self._max_pieces = max_pieces
        self._pieces: OrderedDict[str, TokenIds] = OrderedDict()

    def __call__(self, text: str, previous: ChatTokens | None = None) -> ChatTokens:
        return encode_chat_text(text, self._piece, self.split_before, previous)

    def _piece(self, text: str) -> Sequence[int]:
        if len(text) < self._min_chars:
            return self._encode(text)
        ids = self._pieces.get(text)
        if ids is not None:
            self._pieces.move_to_end(text)
            return ids
        ids = self._pieces[text] = token_ids(self._encode(text))
        if len(self._pieces) > self._max_pieces:
            self._pieces.popitem(last=False)
        return ids


def _shared_cut(previous: ChatTokens, text: str, splitter: re.Pattern[str]) -> int | None:
    """Index of the last cut of `previous` whose text before it `text` repeats and after
    which `text` also starts with a split string; None when there is none."""
    cuts = previous.cuts
    lo, hi = 0, len(cuts) - 1
    if hi < 0 or not text.startswith(previous.text[: cuts[0][0]]):
        return None
    while lo < hi:  # the shared prefix only shrinks as the cut moves right
        mid = (lo + hi + 1) // 2
        if text.startswith(previous.text[: cuts[mid][0]]):
            lo = mid
        else:
            hi = mid - 1
    for i in range(lo, -1, -1):
        offset = cuts[i][0]
        if offset == 0 or splitter.match(text, offset):
            return i
    return None


_SPLITTERS: dict[tuple[str, ...], re.Pattern[str]] = {}


def _splitter(strings: tuple[str, ...]) -> re.Pattern[str]:
    pattern = _SPLITTERS.get(strings)
    if pattern is None:
        pattern = _SPLITTERS[strings] = re.compile("|".join(map(re.escape, strings)))
    return pattern
