"""Where a stack's TTFT p95 goes: the requests that set it, their time split by cause.

The requests that set the p95 are those whose TTFT is within `BAND` of it (the whole tail
over it is mostly first turns and other long prefills, which miss any target). Each such
request's time to first token is read as the latency model's parts (the same
`LatencyModel` that timed the replay) and what is left:
- `own_prefill_s`: its uncached tokens on its cached ones in one pass, alone on the GPU (what
  the TTFT floor counts, here with the prefix this stack kept, not the best it could);
- `chunking_s`: what cutting that prefill into the workers' chunks adds (each later chunk
  reads the cached context again), cut as if always beside another request (vLLM's
  `long_prefill_token_threshold`, the whole step where one prompt computes a step; a
  request alone is not cut, so this is an upper bound);
- `host_load_s`: copying its tokens found in the host tier back to HBM, one batched copy;
- `waiting_s`: the rest: steps shared with other requests' prefills and decodes, queueing,
  waiting for room in the KV pool.

Means over the band, and the share of the band that prefilled more than
`LONG_PREFILL_TOKENS` (a first turn, a compacted prompt, or a prefix the stack let go).
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.domain.percentile import nearest_rank
from appliance.perf.latency import CopyDirection, LatencyModel
from appliance.replay.bounds import prefill_alone_s
from appliance.sim.runtime.virtual import RequestRecord

BAND = 0.1
"""The share of the p95 either side of it that counts as at the p95."""
LONG_PREFILL_TOKENS = 16384
"""More uncached tokens than a turn appends to its session's last prompt: in the recorded
Claude Code sessions the p95 of those is 8,035 and 2.6 % of turns exceed this."""


def ttft_at_p95(
    records: Sequence[RequestRecord], latency: LatencyModel, prefill_cap: int
) -> dict[str, float | int | None]:
    """The split above for `records`' requests whose TTFT is within `BAND` of the p95."""
    ttfts = [t for r in records if (t := r.ttft_s) is not None]
    p95 = nearest_rank(ttfts, 0.95)
    if p95 is None:
        return dict.fromkeys(_FIELDS)
    low, high = p95 * (1 - BAND), p95 * (1 + BAND)
    band = [r for r in records if r.ttft_s is not None and low <= r.ttft_s <= high]  # never empty
    sums = dict.fromkeys(_PARTS, 0.0)
    long = 0
    for r in band:
        fresh = r.prompt_tokens - r.cached_tokens
        own = latency.prefill_s(fresh, r.cached_tokens)
        chunk = prefill_cap if prefill_cap > 0 else r.prompt_tokens  # 0: vLLM cuts nothing
        chunked = prefill_alone_s(latency, r.prompt_tokens, r.cached_tokens, chunk)
        host = latency.kv_copy_s(r.host_cached_tokens, CopyDirection.H2D)
        sums["own_prefill_s"] += own
        sums["chunking_s"] += chunked - own
        sums["host_load_s"] += host
        sums["waiting_s"] += (r.ttft_s or 0.0) - chunked - host
        long += fresh > LONG_PREFILL_TOKENS
    n = len(band)
    out: dict[str, float | int | None] = {"requests": n}
    out |= {k: round(v / n, 4) for k, v in sums.items()}
    out["long_prefill_share"] = round(long / n, 4)
    return out


_PARTS = ("own_prefill_s", "chunking_s", "host_load_s", "waiting_s")
_FIELDS = ("requests", *_PARTS, "long_prefill_share")
