"""The retention of workers that have no retention channel (`ports.KvRetention` with
`controls` False): vLLM or simulated workers started with `engine.kv_retention: false`,
and external vLLM (`engine.kind: external`). The idle reaper still decides and records
every decision; nothing reaches a worker, whose KV stays in its engine's own eviction
order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from appliance.domain.records import WorkerId
from appliance.domain.retention import HostTierSize, RetainedKv, ReturnedKv


class NoRetention:
    controls = False

    def __init__(self, why: str) -> None:
        self.why = why
        """Why nothing is sent, for the log and the state."""

    async def hold(self, worker: WorkerId, key: str, until_s: float, priority: float) -> bool:
        return False

    async def release(self, worker: WorkerId, key: str) -> bool:
        return False

    async def evict_first(
        self, worker: WorkerId, key: str, keep_blocks: int = 0, drop_host: bool = False
    ) -> bool:
        return False

    async def demote(self, worker: WorkerId, key: str) -> bool:
        return False

    async def restore(self, worker: WorkerId, key: str, until_s: float, priority: float) -> bool:
        return False

    async def order(self, worker: WorkerId, priorities: Mapping[str, float]) -> bool:
        return False

    def host_tier(self, worker: WorkerId) -> HostTierSize | None:
        return None

    def retained(self, worker: WorkerId) -> Mapping[str, RetainedKv]:
        return {}

    def kv_usage(self, worker: WorkerId) -> float | None:
        return None

    async def returned(self) -> AsyncIterator[ReturnedKv]:
        await asyncio.Event().wait()  # nothing is ever given back
        yield  # type: ignore[misc]  # pragma: no cover
