"""Prefills a worker did beside other requests of the router's are not its speed.

Under load (router_overhead.py, 50 sessions on two simulated workers that run exactly at
the profile's speed) the worker speeds measured 2-6x: a sample was taken from any interval
with calm readings at both ends (at most one request running, none waiting), and twice a
second leaves room for several short requests in between, each prefilled in steps shared
with the others. A worker measured slower than the other then looked slower to the policy,
which scales queues and prefills by the slowdown, and sessions left the prefix they had
there for a cold prefill on the other worker (cache hit 0.942 against the relays' 0.981,
first byte p99 2.9 s against 0.86 s)."""

from __future__ import annotations

from appliance.domain.records import SessionId, TaskId, TenantId, TurnId, WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.policy.routing import RouteKind
from appliance.services.turns.turn import TurnRequest
from appliance.services.workers.worker_speed import WorkerSpeeds
from tests.fakes import FixedIndex, LinearCost, ManualClock, RouterWorker, Wired, wired_desk

COST = LinearCost()  # 1 ms per fresh token, 0.1 ms per reused one
PROMPT, RESIDENT = 1_000, 960  # a session's next turn: 40 fresh tokens on 60 blocks
WARM_S = COST.prefill_s(PROMPT - RESIDENT, RESIDENT)  # 0.136 s at the profile's speed
W0, W1 = WorkerId("w0"), WorkerId("w1")


def reading(at: float, count: int, prefill_s: float, running: int = 0) -> LoadSnapshot:
    """`count` finished requests of the session's shape since the engine started."""
    return LoadSnapshot(
        time=at,
        running=running,
        waiting=0,
        kv_cache_usage_perc=0.0,
        prompt_tokens=count * PROMPT,
        prefill_sum_s=prefill_s,
        prefill_count=count,
        prefill_fresh_tokens=count * (PROMPT - RESIDENT),
        prefill_prompt_tokens=count * PROMPT,
    )


def setup() -> tuple[Wired, WorkerSpeeds, list[RouterWorker]]:
    clock = ManualClock(100.0)
    workers = [RouterWorker(W0, None), RouterWorker(W1, None)]
    wired = wired_desk(workers, clock=clock, index=FixedIndex({W1: RESIDENT // 16}))
    for w in workers:
        w.load = reading(clock.t, 0, 0.0)
    wired.speeds.observe(workers)  # both calm, nothing done yet
    return wired, wired.speeds, workers


def served(wired: Wired, worker: WorkerId, starts: list[float], took_s: float) -> None:
    """The router's turns at `worker`, sent at `starts` and answered `took_s` later."""
    ends = sorted((t + took_s, f"{worker}-{t}") for t in starts)
    for t in starts:
        wired.clock.t = t
        wired.queues.sent(worker, TurnId(f"{worker}-{t}"), WARM_S, t)
    for t, turn in ends:
        wired.clock.t = t
        wired.queues.ended(worker, TurnId(turn), failed=False)


def place_next_turn(wired: Wired, at: float) -> tuple[WorkerId | None, RouteKind]:
    """A new session over the context resident at w1, while 4 of the router's turns wait
    there (each 40 fresh tokens on the same kind of prefix)."""
    wired.clock.t = at
    est = wired.queues.prefill_s(W1, PROMPT - RESIDENT, RESIDENT)  # as the desk sends it
    for i in range(4):
        wired.queues.sent(W1, TurnId(f"waiting-{i}"), est, at)
    turn = TurnRequest(
        TenantId("a"),
        "/v1/chat/completions",
        {"model": "m"},
        list(range(PROMPT)),
        TaskId("a/t"),
        SessionId("s"),
    )
    session = wired.desk.sessions.open(TenantId("a"), SessionId("s"), at)
    decision = wired.desk.placer.place(turn, session).decision
    return decision.worker, decision.kind


def test_prefills_batched_with_the_routers_other_turns_do_not_move_sessions() -> None:
    wired, speeds, (w0, w1) = setup()
    # Four turns at w1 within half a second, each in flight while the next arrived: their
    # prefills shared the worker's steps and took 3x the profile's time. Both readings calm.
    served(wired, W1, [100.05, 100.10, 100.15, 100.20], took_s=0.2)
    w0.load, w1.load = reading(100.5, 0, 0.0), reading(100.5, 4, 4 * 3 * WARM_S)
    speeds.observe([w0, w1])
    assert speeds.slowdown(W1) == 1.0  # batching, not speed
    assert place_next_turn(wired, 101.0) == (W1, RouteKind.PREFIX_RESIDENT)


def test_prefills_of_turns_one_at_a_time_are_the_workers_speed() -> None:
    wired, speeds, (w0, w1) = setup()
    # The same four turns one after the other: each prefill had the worker to itself.
    served(wired, W1, [100.05], took_s=0.1)
    served(wired, W1, [100.16], took_s=0.1)
    served(wired, W1, [100.27], took_s=0.1)
    served(wired, W1, [100.38], took_s=0.1)
    served(wired, W0, [100.05, 100.16, 100.27, 100.38], took_s=0.1)  # other sessions' turns
    w0.load, w1.load = reading(100.5, 4, 4 * WARM_S), reading(100.5, 4, 4 * 3 * WARM_S)
    speeds.observe([w0, w1])
    assert speeds.slowdown(W0) == 1.0
    assert speeds.slowdown(W1) == 3.0  # really 3x slower: a cold prefill at w0 is quicker
    assert place_next_turn(wired, 101.0) == (W0, RouteKind.QUEUE_OVER_PREFIX)
