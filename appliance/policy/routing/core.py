"""The routing mechanism's boundary types and the default scorers (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from appliance.domain.records import WorkerId


class PrefillCost(Protocol):
    """Seconds to prefill `fresh` tokens on top of `reused` resident ones (a GPU profile)."""

    def prefill_s(self, fresh: int, reused: int = 0) -> float: ...


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    prompt_tokens: int
    session_home: WorkerId | None = None
    """The worker that served this session's previous turn, if any."""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the router knows of one worker at decision time."""

    worker: WorkerId
    models: frozenset[str]
    healthy: bool = True
    excluded: bool = False
    """This turn may not go there: an earlier attempt of it failed there, or it is pinned
    to another worker."""
    draining: bool = False
    resident_tokens: int = 0
    """Leading tokens of this request's prompt resident in the worker's KV cache (index)."""
    queue_s: float = 0.0
    """Estimated wait before this request's prefill starts there."""
    queued_share: float = 0.0
    """This worker's share (0..1) of all queued work across workers."""
    kv_usage: float = 0.0
    """Share of the worker's KV pool in use (vLLM's `kv_cache_usage_perc`)."""
    kv_held: float = 0.0
    """Of `kv_usage`, the share idle sessions' holds keep: the appliance gives it back as
    soon as a request needs the room, so it is not load."""
    kv_pool_tokens: int = 0
    """Tokens the worker's KV pool holds (vLLM's `cache_config_info`; 0: not known yet)."""
    recent_failures: int = 0
    slowdown: float = 1.0
    """This worker's measured prefill seconds per second of the cost model's (1: as fast
    as the profile says)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    worker: WorkerId
    score: float
    scores: Mapping[str, float]
    resident_tokens: int
    ttft_estimate_s: float
    prefill_s: float
    """Of `ttft_estimate_s`, the turn's own prefill there (the rest is the queue)."""


class RouteKind(StrEnum):
    """Why the policy picked its worker: a fixed set, like admission's refusal codes."""

    NO_ELIGIBLE = "no_eligible"
    ONLY_ELIGIBLE = "only_eligible"
    MOVED = "moved"
    """Away from the session's home: the estimated time to first token is lower here."""
    PREFIX_RESIDENT = "prefix_resident"
    QUEUE_OVER_PREFIX = "queue_over_prefix"
    """The worker holding most of the prefix queues for longer than the prefix saves."""
    LEAST_TTFT = "least_ttft"


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker: WorkerId | None
    kind: RouteKind
    """Why, as one of a fixed set (metric labels, counts)."""
    reason: str
    """Why, as a sentence with its figures (the ledger, the console)."""
    candidates: tuple[Candidate, ...] = ()
    excluded: Mapping[str, str] = field(default_factory=dict)
    """Worker -> the filter that excluded it."""

    @property
    def chosen(self) -> Candidate | None:
        """The picked worker's candidate, ranked first (None: no candidate was weighed)."""
        return self.candidates[0] if self.candidates else None


@dataclass(frozen=True, slots=True)
class Context:
    """Per-decision values every scorer may need."""

    request: RouteRequest
    cost: PrefillCost
    worst_prefill_s: float
    """The turn's prefill from scratch on the slowest eligible worker."""
    scale_s: float
    """What the reuse and queue scores divide their seconds by: the worst case, at least
    `SCORE_SCALE_FLOOR_S`."""
    waits_s: Mapping[WorkerId, float]
    """Each eligible worker's `wait_s` for the turn, worked out once per decision."""


SCORE_SCALE_FLOOR_S = 0.5
"""The least scale scores are weighed on. Reuse and queue keep their ratio at any scale;
the floor only sets what the absolute tie-breakers are worth in seconds: with it, the
session's affinity (0.05) weighs as 25 ms of queue. A short prompt's worst prefill is a few
milliseconds, and at that scale the jitter of the estimates (a worker's measured speed, a
queue seen a step late) outweighed the affinity: on real vLLM a session moved for an
estimated 1 ms (12 against 13 ms). An agent turn's worst prefill is seconds."""


Filter = Callable[[RouteRequest, WorkerView], bool]
Scorer = Callable[[Context, WorkerView], float]


def healthy(_: RouteRequest, w: WorkerView) -> bool:
    return w.healthy


def not_excluded(_: RouteRequest, w: WorkerView) -> bool:
    return not w.excluded


def not_draining(_: RouteRequest, w: WorkerView) -> bool:
    return not w.draining


def serves_model(req: RouteRequest, w: WorkerView) -> bool:
    return req.model in w.models


def _prefill_s(ctx: Context, w: WorkerView) -> float:
    """The prefill the turn would do on `w`: its fresh tokens over the resident prefix, at
    the worker's speed."""
    reused = min(w.resident_tokens, ctx.request.prompt_tokens)
    return ctx.cost.prefill_s(ctx.request.prompt_tokens - reused, reused) * w.slowdown


def _saved_s(ctx: Context, w: WorkerView) -> float:
    """Prefill seconds `w` saves against the worst case (a cold prefill on the slowest
    worker): with workers alike, what its resident prefix saves."""
    return ctx.worst_prefill_s - _prefill_s(ctx, w)


MEMORY_WAIT_S = 6.0
"""What a turn is taken to wait, beyond the queue, on a worker whose pool has no room for its
whole prompt (idle holds counted as room): vLLM schedules it only as running turns end and
give their KV back, and an agent turn decodes for seconds. Near capacity one worker's
sessions outgrew its HBM and each returning turn waited there 10 to 30 s for a copy back
from the host tier that takes a quarter of a second. 6 s led a sweep of 1.5 to 20 s on the
recorded sessions near capacity (docs/router.md)."""


def wait_s(request: RouteRequest, w: WorkerView) -> float:
    """The estimated wait before the turn's prefill starts on `w`: the worker's queue, and
    `MEMORY_WAIT_S` more where its pool lacks room for the prompt (pool size known)."""
    if w.kv_pool_tokens <= 0:
        return w.queue_s
    room = (1.0 - (w.kv_usage - w.kv_held)) * w.kv_pool_tokens
    return w.queue_s + (MEMORY_WAIT_S if request.prompt_tokens > room else 0.0)


def reuse(ctx: Context, w: WorkerView) -> float:
    return _clip(_saved_s(ctx, w) / ctx.scale_s)


def queue(ctx: Context, w: WorkerView) -> float:
    return _clip(1.0 - ctx.waits_s[w.worker] / ctx.scale_s)


def kv_pressure(_: Context, w: WorkerView) -> float:
    """The pool's free share, counting held idle KV as free: with every pool full of holds,
    usage alone would no longer tell a busy worker from an idle one."""
    return _clip(1.0 - (w.kv_usage - w.kv_held))


def failures(_: Context, w: WorkerView) -> float:
    return 1.0 / (1.0 + w.recent_failures)


def bounded_affinity(max_share: float) -> Scorer:
    """1 on the session's last worker unless it carries more than `max_share` of the queue."""

    def affinity(ctx: Context, w: WorkerView) -> float:
        home = ctx.request.session_home == w.worker
        return 1.0 if home and w.queued_share <= max_share else 0.0

    return affinity


def _clip(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


@dataclass(frozen=True, slots=True)
class RoutingProfile:
    name: str
    filters: tuple[tuple[str, Filter], ...]
    scorers: tuple[tuple[str, float, Scorer], ...]
    """(name, weight, scorer); weights live here, never inside scorers."""


def default_profile(
    *,
    reuse_weight: float = 2.0,
    queue_weight: float = 1.0,
    kv_pressure_weight: float = 0.1,
    affinity_weight: float = 0.05,
    failures_weight: float = 0.2,
    affinity_max_share: float = 0.5,
) -> RoutingProfile:
    return RoutingProfile(
        name="appliance",
        filters=(
            ("healthy", healthy),
            ("not_excluded", not_excluded),
            ("not_draining", not_draining),
            ("model", serves_model),
        ),
        scorers=(
            ("reuse", reuse_weight, reuse),
            ("queue", queue_weight, queue),
            ("kv_pressure", kv_pressure_weight, kv_pressure),
            ("affinity", affinity_weight, bounded_affinity(affinity_max_share)),
            ("failures", failures_weight, failures),
        ),
    )


def route(
    request: RouteRequest,
    workers: Sequence[WorkerView],
    cost: PrefillCost,
    profile: RoutingProfile,
) -> RouteDecision:
    """Pick a worker for `request`; the decision carries every candidate's scores and why."""
    excluded: dict[str, str] = {}
    eligible = []
    for w in workers:
        failed = next((name for name, keep in profile.filters if not keep(request, w)), None)
        if failed is None:
            eligible.append(w)
        else:
            excluded[w.worker] = failed
    if not eligible:
        return RouteDecision(None, RouteKind.NO_ELIGIBLE, "no eligible worker", (), excluded)
    worst = cost.prefill_s(request.prompt_tokens, 0) * max(w.slowdown for w in eligible)
    waits = {w.worker: wait_s(request, w) for w in eligible}
    scale = max(worst, *waits.values(), SCORE_SCALE_FLOOR_S)
    ctx = Context(request, cost, worst, scale, waits)
    candidates = []
    for w in eligible:
        scores = {name: scorer(ctx, w) for name, _, scorer in profile.scorers}
        total = sum(weight * scores[name] for name, weight, _ in profile.scorers)
        prefill = _prefill_s(ctx, w)
        ttft = waits[w.worker] + prefill
        candidates.append(Candidate(w.worker, total, scores, w.resident_tokens, ttft, prefill))
    # Highest score first; ties go to the worker listed first (stable, deterministic).
    ranked = tuple(sorted(candidates, key=lambda c: -c.score))
    return RouteDecision(ranked[0].worker, *_reason(request, ranked), ranked, excluded)


def _reason(request: RouteRequest, ranked: Sequence[Candidate]) -> tuple[RouteKind, str]:
    best = ranked[0]
    if len(ranked) == 1:
        return RouteKind.ONLY_ELIGIBLE, "only eligible worker"
    home = next((c for c in ranked if c.worker == request.session_home), None)
    most_resident = max(ranked, key=lambda c: c.resident_tokens)
    if home is not None and home.worker != best.worker:
        return RouteKind.MOVED, (
            f"moved from {home.worker}: est. TTFT {best.ttft_estimate_s * 1e3:.0f} ms here vs "
            f"{home.ttft_estimate_s * 1e3:.0f} ms there"
        )
    if best.resident_tokens > 0 and best.worker == most_resident.worker:
        return RouteKind.PREFIX_RESIDENT, f"prefix resident ({best.resident_tokens} tokens)"
    if most_resident.resident_tokens > best.resident_tokens:
        return RouteKind.QUEUE_OVER_PREFIX, (
            f"queue at {most_resident.worker} costs more than its "
            f"{most_resident.resident_tokens} resident tokens save"
        )
    return RouteKind.LEAST_TTFT, "least estimated time to first token"
