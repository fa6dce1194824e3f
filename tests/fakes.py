"""Small twins the unit tests share: a clock the test moves, a prefill cost easy to check
by hand."""

from __future__ import annotations


class ManualClock:
    """`now()` is `t`; `sleep` moves it on without waiting."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


class LinearCost:
    """1 ms per fresh token plus 0.1 ms per reused token."""

    def prefill_s(self, fresh: int, reused: int = 0) -> float:
        return fresh * 1e-3 + reused * 1e-4
