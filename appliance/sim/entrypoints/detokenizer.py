"""Token ids to text as a stream: vLLM's incremental detokenizer, for the simulated server."""

from __future__ import annotations

from collections.abc import Sequence

from appliance.tokenization.tokenizer import ModelTokenizer


class IncrementalDecoder:
    """Text deltas of a growing token sequence, holding back incomplete characters (the
    prefix/read-offset scheme of vLLM's detokenizer)."""

    def __init__(self, tokenizer: ModelTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        decode = self._tok.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""
