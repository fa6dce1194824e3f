"""After a large request body the appliance hands freed memory back to the OS: once, a
moment after the body, however many large bodies came in that moment."""

from __future__ import annotations

import asyncio

from appliance.api.http_server.heap_trim import LARGE_BODY, HeapTrim
from appliance.eventloop import run


def test_a_large_body_is_followed_by_one_trim_and_a_small_one_by_none() -> None:
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    async def main() -> None:
        heap = HeapTrim(trim, delay_s=0.02)
        heap.after(LARGE_BODY - 1)
        await asyncio.sleep(0.05)
        assert calls == []
        for _ in range(3):
            heap.after(LARGE_BODY)
        assert calls == []  # not at once: a moment later
        await asyncio.sleep(0.05)
        assert calls == [0]
        heap.after(8 * LARGE_BODY)
        await asyncio.sleep(0.05)
        assert calls == [0, 0]

    run(main())
