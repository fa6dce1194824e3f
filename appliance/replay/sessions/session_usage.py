"""What a stack's run spends, as an `on_step` watcher of the agent-session replay: the
GPU-seconds each session took, and the box's HBM and host memory over time.

GPU-seconds: each engine step's modelled duration split over the requests it scheduled in
proportion to their scheduled tokens (as `closed_loop.GpuSeconds`), summed per session (a
request id is `session/step`: `session_loop.py`; a sub-agent is a session of its own). The
row gives the total over every session, the mean and p50 over the sessions that ran to
their end (one cut off at the run's end has spent only part of its cost), and the engines'
busy time (steps that only wait for host loads schedule nothing and are charged to no
session).

Memory over time: every `every_s` of virtual time, the mean over workers of HBM held (the
share of KV blocks requests or residency holds reference: vLLM's `kv_cache_usage_perc`),
HBM cached (the share of blocks holding a cached prefix, referenced or not: what the next
turn can reuse) and the host tier's fill; sampled at the first step at or after each mark,
so a series is as fine as the engines' steps. The row keeps the samples in its counted
window (`usage`) and their means and maxima.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence, Set

from appliance.sim.core.engine import SimEngine
from appliance.sim.engine_io import StepResult

USAGE_EVERY_S = 60.0


class SessionUsage:
    def __init__(self, engines: Sequence[SimEngine], *, every_s: float = USAGE_EVERY_S) -> None:
        self._engines = engines
        self.every_s = every_s
        self.gpu_s_by_session: dict[str, float] = {}
        self.samples: list[tuple[float, float, float, float | None]] = []
        """(mark, HBM held, HBM cached, host fill or None without a host tier)."""
        self._next_s = 0.0

    def on_step(self, i: int, now: float, result: StepResult) -> None:
        total = result.num_scheduled_tokens
        if total:
            per_token = result.duration_s / total
            spent = self.gpu_s_by_session
            for rid, n in result.scheduled.items():
                session = rid.rpartition("/")[0] or rid
                spent[session] = spent.get(session, 0.0) + per_token * n
        while now >= self._next_s:
            self.samples.append((self._next_s, *self._reading()))
            self._next_s += self.every_s

    def _reading(self) -> tuple[float, float, float | None]:
        held = cached = host = 0.0
        hosts = 0
        for e in self._engines:
            cache = e.cache
            held += cache.usage
            cached += cache.pool.cached_hashes / max(cache.num_blocks - 1, 1)
            if cache.host is not None:
                host += len(cache.host) / cache.host.num_blocks
                hosts += 1
        n = max(len(self._engines), 1)
        return held / n, cached / n, (host / hosts if hosts else None)

    def fields(self, start_s: float, end_s: float, ended: Set[str]) -> dict[str, object]:
        """The row's figures; memory from the samples in (`start_s`, `end_s`], cost per
        session over the sessions in `ended` (those that ran to their end)."""
        by_session = self.gpu_s_by_session
        spent = [v for k, v in by_session.items() if k in ended]
        kept = [s for s in self.samples if start_s < s[0] <= end_s]
        out: dict[str, object] = {
            "gpu_s": round(sum(by_session.values()), 3),
            "gpu_busy_s": round(sum(e.stats.busy_s_total for e in self._engines), 3),
            "gpu_s_sessions": len(spent),
            "gpu_s_per_session": round(statistics.fmean(spent), 3) if spent else None,
            "gpu_s_per_session_p50": round(statistics.median(spent), 3) if spent else None,
        }
        for k, name in enumerate(("hbm_held", "hbm_cached", "host_used"), start=1):
            values: list[float] = [v for s in kept if (v := s[k]) is not None]
            out[f"{name}_mean"] = round(statistics.fmean(values), 4) if values else None
            out[f"{name}_max"] = round(max(values), 4) if values else None
        out["usage"] = {
            "every_s": self.every_s,
            "t_s": [s[0] for s in kept],
            "hbm_held": [round(s[1], 4) for s in kept],
            "hbm_cached": [round(s[2], 4) for s in kept],
            "host_used": [None if s[3] is None else round(s[3], 4) for s in kept],
        }
        return out
