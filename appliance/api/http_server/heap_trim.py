"""Handing memory back to the OS after a large request body.

A body near the limit becomes Python objects many times its size while it is checked (8 MiB
of small JSON objects: about 200 MiB), all freed once it is answered. glibc keeps much of
what was freed: its threshold for serving a block by mmap rises with each large block freed,
so the next large blocks come from the heap, and the heap gives back only its free top (an
appliance that had settled at 85 MiB stayed at 157 MiB after a dozen such bodies).
`malloc_trim(0)` returns every free page: it runs a second after a large body, at most once
a second (about 2 ms for a heap of a few hundred MiB). Where there is no glibc it does
nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable

LARGE_BODY = 1 << 20
"""A body of at least this many bytes is followed by a trim."""
DELAY_S = 1.0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, from the symbols the process has loaded (no library search)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


class HeapTrim:
    """`after(n)` once a request with a body of n bytes has been answered or refused."""

    def __init__(
        self, trim: Callable[[int], int] | None = None, *, delay_s: float = DELAY_S
    ) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self._delay_s = delay_s
        self._pending: asyncio.TimerHandle | None = None

    def after(self, body_bytes: int) -> None:
        if body_bytes < LARGE_BODY or self._trim is None or self._pending is not None:
            return
        self._pending = asyncio.get_running_loop().call_later(self._delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        if self._trim is not None:
            self._trim(0)
