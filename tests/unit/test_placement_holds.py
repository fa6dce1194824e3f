"""Idle sessions' holds are room a worker gives back on demand, not load: with every pool
full (holds keep them so on a busy box), a new session goes where running requests use less
of the pool, which the usage reading alone cannot tell."""

from __future__ import annotations

from collections.abc import Mapping

from appliance.domain.records import SessionId, TaskId, TenantId, WorkerId
from appliance.domain.retention import RetainedKv
from appliance.domain.worker import LoadSnapshot
from appliance.services.turns.turn import TurnRequest
from tests.fakes import RouterWorker, wired_desk

BUSY, HOLDING = WorkerId("w-busy"), WorkerId("w-holding")
POOL = 10_000


def full(pool: int | None = POOL) -> LoadSnapshot:
    return LoadSnapshot(
        time=0.0, running=1, waiting=0, kv_cache_usage_perc=0.95, kv_capacity_tokens=pool
    )


class Retention:
    """The retention port's report side, as its connectors last reported."""

    def __init__(self, holds: Mapping[WorkerId, list[int]]) -> None:
        self._holds = holds

    def retained(self, worker: WorkerId) -> Mapping[str, RetainedKv]:
        tokens = self._holds.get(worker, [])
        return {f"k{i}": RetainedKv(f"k{i}", n, 0.0, 1.0) for i, n in enumerate(tokens)}


def first_turn_goes_to(
    holds: Mapping[WorkerId, list[int]],
    pool: int | None = POOL,
    pools: Mapping[WorkerId, int | None] | None = None,
) -> WorkerId:
    """Where a new session's first turn (100 tokens) goes, both pools 95 % in use, the busy
    worker listed first (ties go to it); `holds`: the tokens of each hold its connector
    reports; `pools`: a pool size per worker, where not `pool`."""
    sizes = pools or {}
    workers = [RouterWorker(w, client=None, load=full(sizes.get(w, pool))) for w in (BUSY, HOLDING)]
    wired = wired_desk(workers, retention=Retention(holds))
    session = wired.desk.sessions.open(TenantId("a"), SessionId("s"), 0.0)
    turn = TurnRequest(
        TenantId("a"),
        "/v1/completions",
        {"model": "m"},
        list(range(100)),
        TaskId("a/t"),
        SessionId("s"),
    )
    worker = wired.desk.placer.place(turn, session).decision.worker
    assert worker is not None
    return worker


def test_a_pool_kept_full_by_holds_takes_the_new_session() -> None:
    assert first_turn_goes_to({HOLDING: [8_000], BUSY: [500]}) == HOLDING


def test_without_holds_the_usage_alone_decides() -> None:
    assert first_turn_goes_to({}) == BUSY


def test_holds_count_for_nothing_while_the_pool_size_is_unknown() -> None:
    assert first_turn_goes_to({HOLDING: [8_000]}, pool=None) == BUSY


def test_a_hold_counts_only_while_its_worker_holds_it() -> None:
    """Two holds on one worker (6,000 tokens) weigh as much as one of 6,000."""
    assert first_turn_goes_to({HOLDING: [4_000, 2_000], BUSY: [500]}) == HOLDING
    assert first_turn_goes_to({HOLDING: [300, 200], BUSY: [500]}) == BUSY


def test_a_pool_without_room_for_the_prompt_loses_the_turn() -> None:
    """95 % in use: 50 tokens free of 1,000, no room for the 100-token prompt; 500 of 10,000."""
    assert first_turn_goes_to({}, pools={BUSY: 1_000}) == HOLDING
    assert first_turn_goes_to({}, pools={BUSY: 1_000, HOLDING: 1_000}) == BUSY  # both wait
    assert first_turn_goes_to({BUSY: [100]}, pools={BUSY: 1_000}) == BUSY  # a hold is room
