"""The retention connector's twin in the simulated engine (`appliance/sim/kv/retention.py`):
directives applied at the next step, holds over the sim's block pool, given back before an
admission would wait or a running request be preempted (never the admitted request's own
session's, lowest priority first), capped, and reported. A stand-in takes the control
channel's place: the test queues directives on it and reads the reports it was given
(tests/integration/test_retention_engines.py runs the real channel against the sim)."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

from appliance.domain.block_hash import BlockHasher
from appliance.engines.retention.plugin import RetentionTuning
from appliance.engines.retention.protocol import (
    GiveBackReason,
    GivenBack,
    RetentionDemote,
    RetentionDirective,
    RetentionEvictFirst,
    RetentionHold,
    RetentionOrder,
    RetentionRelease,
    RetentionReport,
    RetentionRestore,
)
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.engine_io import RequestOutput, SimRequest
from appliance.sim.kv.cache_request import NO_HIT, CacheRequest
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.retention import SimRetention

BS = 32
POOL = 64  # usable blocks
HASHER = BlockHasher.for_engine("sha256_cbor", BS, "0")
LAT = LatencyModel.from_profile(bundled_profile())
PRESSURE = GiveBackReason.PRESSURE


class StandIn:
    """The control channel as the twin uses it: directives in, reports out."""

    def __init__(self) -> None:
        self.directives: queue.SimpleQueue[RetentionDirective] = queue.SimpleQueue()
        self.reports: list[RetentionReport] = []
        self.closed = False

    def pending(self) -> Iterator[RetentionDirective]:
        while not self.directives.empty():
            yield self.directives.get_nowait()

    def publish(self, report: RetentionReport) -> None:
        self.reports.append(report)

    def close(self) -> None:
        self.closed = True

    @property
    def held(self) -> dict[str, int]:
        return {h.key: h.blocks for h in self.reports[-1].held}

    def given_back(self) -> list[GivenBack]:
        return [g for r in self.reports for g in r.given_back]


class Sim:
    """An engine with the twin, and the requests it served."""

    def __init__(self, pool: int = POOL, *, retention: bool = True, host: int = 0) -> None:
        self.channel = StandIn()
        self.retention = SimRetention(RetentionTuning(), block_size=BS) if retention else None
        if self.retention is not None:
            self.retention.start(self.channel)
        config = EngineConfig(num_blocks=pool + 1, block_size=BS, max_model_len=pool * BS)
        tier = HostTier(host) if host else None
        self.engine = SimEngine(
            config, hasher=HASHER, latency=LAT, retention=self.retention, host=tier
        )
        self.now = 0.0
        self.preempted: list[str] = []
        self._n = 0

    def send(self, *directives: RetentionDirective) -> None:
        for d in directives:
            self.channel.directives.put(d)

    def serve(self, *requests: SimRequest) -> dict[str, RequestOutput]:
        """Runs the requests together until all finished; the last output of each."""
        for r in requests:
            self.engine.add_request(r, self.now)
        last: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            result = self.engine.step(self.now)
            self.now += max(result.duration_s, 1e-3)
            self.preempted += result.preempted
            last.update((o.request_id, o) for o in result.outputs)
        return last

    def turn(self, session: str, prompt: list[int], max_tokens: int = 16) -> RequestOutput:
        self._n += 1
        req = SimRequest(f"r{self._n}", prompt, max_tokens, session_id=session)
        return self.serve(req)[req.request_id]

    def poke(self) -> None:
        """A one-token request: the step that applies what was sent."""
        self.turn("t/poke", tokens(10**6 + self._n, 8), max_tokens=1)

    def flood(self, blocks: int) -> None:
        for i in range(blocks // 8):
            self.turn(f"t/flood-{self._n}", tokens(10**5 * (self._n + 1) + i, 8 * BS))


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def later(s: float = 60.0) -> float:
    return time.time() + s


def test_a_finished_turn_is_remembered_not_held_until_asked() -> None:
    sim = Sim()
    assert sim.channel.reports[-1].pool_blocks == POOL and sim.channel.held == {}
    sim.turn("t/a", tokens(0, 10 * BS))
    assert sim.channel.held == {} and sim.engine.cache.num_free_blocks == POOL
    sim.send(RetentionHold("t/a", later()))
    assert sim.channel.held == {}  # applied at the next step
    sim.poke()
    assert sim.channel.held == {"t/a": 10}  # 320 prompt + 15 computed tokens: 10 full blocks
    assert sim.engine.cache.num_free_blocks == POOL - 10


def test_a_held_session_survives_a_flood_three_times_the_pool_an_unheld_one_does_not() -> None:
    sim = Sim()
    held, free = tokens(0, 10 * BS), tokens(5000, 10 * BS)
    sim.turn("t/held", held)
    sim.turn("t/free", free)
    sim.send(RetentionHold("t/held", later()))
    sim.flood(3 * POOL)
    assert sim.channel.given_back() == [] and sim.channel.held == {"t/held": 10}
    assert sim.turn("t/held", [*held, *tokens(9000, 40)]).num_cached_tokens == 10 * BS
    assert sim.turn("t/free", [*free, *tokens(9000, 40)]).num_cached_tokens == 0
    assert sim.preempted == []


def test_admission_gives_holds_back_lowest_priority_first_never_its_own_sessions() -> None:
    sim = Sim()
    for i, key in enumerate(("t/own", "t/low", "t/mid", "t/high")):
        sim.turn(key, tokens(1000 * i, 12 * BS))
    sim.send(
        RetentionHold("t/own", later(), 0.0),  # the lowest, yet never given back for itself
        RetentionHold("t/low", later(), 1.0),
        RetentionHold("t/mid", later(), 2.0),
        RetentionHold("t/high", later(), 3.0),
    )
    sim.poke()
    assert sim.channel.held == {"t/own": 12, "t/low": 12, "t/mid": 12, "t/high": 12}
    # The own session's next turn needs 12 + 25 blocks, and the reserve of 3 (5 % of 64)
    # stays free; 16 are free, its 12 it reuses (one token out: no other block needed).
    out = sim.turn("t/own", [*tokens(0, 12 * BS), *tokens(7000, 25 * BS - 1)], max_tokens=1)
    assert out.num_cached_tokens == 12 * BS
    assert sim.channel.given_back() == [GivenBack("t/low", 12, PRESSURE)]
    assert set(sim.channel.held) == {"t/own", "t/mid", "t/high"}


def test_an_admission_leaves_the_reserve_free_for_the_running_requests() -> None:
    sim = Sim()
    for i, key in enumerate(("t/own", "t/low", "t/mid", "t/high")):
        sim.turn(key, tokens(1000 * i, 12 * BS))
    sim.send(
        *(RetentionHold(k, later(), p) for p, k in enumerate(("t/own", "t/low", "t/mid", "t/high")))
    )
    sim.poke()
    # 12 + 28 blocks: the 16 free and t/low's 12 would just fit it, with nothing left for a
    # running request's next block; the reserve of 3 takes t/mid's too.
    sim.turn("t/own", [*tokens(0, 12 * BS), *tokens(7000, 28 * BS - 1)], max_tokens=1)
    assert [g.key for g in sim.channel.given_back()] == ["t/low", "t/mid"]
    assert set(sim.channel.held) == {"t/own", "t/high"}


def test_a_running_request_short_of_blocks_gets_holds_instead_of_preempting() -> None:
    def burst(sim: Sim) -> None:
        # Two requests admitted with 12 blocks each grow to 24 each while decoding.
        sim.serve(
            *(SimRequest(f"b{i}", tokens(50_000 * (i + 1), 12 * BS), 12 * BS) for i in (0, 1))
        )

    plain = Sim(POOL - 30, retention=False)  # what the holds leave free, without them
    burst(plain)
    assert plain.preempted != []

    sim = Sim()
    for i, key in enumerate(("t/low", "t/mid", "t/high")):
        sim.turn(key, tokens(1000 * i, 10 * BS))
    sim.send(
        *(RetentionHold(k, later(), p) for k, p in (("t/low", 1), ("t/mid", 2), ("t/high", 3)))
    )
    sim.poke()
    assert sum(sim.channel.held.values()) == 30
    burst(sim)
    assert sim.preempted == []
    given = sim.channel.given_back()
    assert [g.key for g in given] == ["t/low", "t/mid", "t/high"][: len(given)] and given
    assert {g.reason for g in given} == {PRESSURE}


def test_after_holds_go_to_a_running_request_nothing_new_is_admitted_in_that_step() -> None:
    sim = Sim()
    sim.turn("t/a", tokens(0, 10 * BS))
    sim.send(RetentionHold("t/a", later()))
    sim.poke()
    twin = sim.retention
    assert twin is not None
    waiting = CacheRequest("w", tokens(9000, 4 * BS), HASHER, session_id="t/w")
    assert twin.admitting(waiting, NO_HIT)
    assert twin.relieve()  # a running request was short of blocks: t/a's hold goes
    assert not twin.admitting(waiting, NO_HIT)  # its room is the running request's
    twin.step_begins()
    assert twin.admitting(waiting, NO_HIT)  # the next step admits again


def test_holds_are_capped_at_80_percent_of_the_pool() -> None:
    sim = Sim()
    sim.turn("t/a", tokens(0, 30 * BS))
    sim.turn("t/b", tokens(5000, 30 * BS))
    sim.send(RetentionHold("t/a", later(), 1.0))
    sim.poke()
    sim.send(
        RetentionHold("t/b", later(), 1.0)
    )  # 60 > 51: the older hold of no higher priority goes
    sim.poke()
    assert sim.channel.held == {"t/b": 30}
    assert sim.channel.given_back() == [GivenBack("t/a", 30, GiveBackReason.CAPPED)]
    sim.turn("t/a", tokens(0, 30 * BS))
    sim.send(RetentionHold("t/a", later(), 0.5))  # lower priority: cut to what fits
    sim.poke()
    assert sim.channel.held == {"t/b": 30, "t/a": int(POOL * 0.8) - 30}


def test_release_evict_first_order_expiry_and_unknown_keys() -> None:
    sim = Sim()
    cache = sim.engine.cache
    sim.turn("t/a", tokens(0, 4 * BS))
    a_blocks = set(cache.cached_blocks())
    sim.turn("t/b", tokens(5000, 4 * BS))
    sim.send(RetentionHold("t/a", later(), 1.0), RetentionHold("t/b", later(), 2.0))
    sim.send(RetentionOrder({"t/a": 5.0}), RetentionHold("t/nobody", later()))
    sim.poke()
    assert [(h.key, h.priority) for h in sim.channel.reports[-1].held] == [
        ("t/b", 2.0),
        ("t/a", 5.0),
    ]
    assert sim.channel.given_back() == [GivenBack("t/nobody", 0, GiveBackReason.NOT_FOUND)]
    sim.send(RetentionEvictFirst("t/a"), RetentionRelease("t/b"))
    sim.poke()
    cached = cache.cached_blocks()
    order = [b for b in cache.free_block_ids() if b in cached]  # the next evicted first
    a_left = a_blocks & set(cached)
    assert len(a_blocks) == 4 and len(a_left) == 3  # the poke took the first evicted: a's
    assert set(order[:3]) == a_left  # b's went to the LRU tail
    assert [(g.key, g.reason) for g in sim.channel.given_back()[1:]] == [
        ("t/a", GiveBackReason.EVICTED),
        ("t/b", GiveBackReason.RELEASED),
    ]
    sim.turn("t/c", tokens(9000, 4 * BS))
    sim.send(RetentionHold("t/c", time.time() + 0.01))
    sim.poke()
    time.sleep(0.02)
    sim.poke()
    assert sim.channel.given_back()[-1] == GivenBack("t/c", 4, GiveBackReason.EXPIRED)
    assert sim.channel.held == {}


def test_an_aborted_request_is_remembered_and_closing_gives_everything_back() -> None:
    sim = Sim()
    sim.engine.add_request(SimRequest("r", tokens(0, 8 * BS), 100, session_id="t/a"), sim.now)
    for _ in range(3):
        sim.engine.step(sim.now)
    sim.engine.abort_request("r", sim.now)
    sim.send(RetentionHold("t/a", later()))
    sim.poke()
    assert sim.channel.held == {"t/a": 8}
    assert sim.retention is not None
    sim.retention.close()
    assert sim.channel.closed and sim.channel.held == {}
    assert sim.channel.given_back()[-1] == GivenBack("t/a", 8, GiveBackReason.RESET)
    assert sim.engine.cache.num_free_blocks == POOL


def test_a_demoted_session_comes_back_from_the_host_tier() -> None:
    sim = Sim(host=4 * POOL)
    assert sim.channel.reports[-1].host_blocks == 4 * POOL
    prompt = tokens(0, 10 * BS)
    sim.turn("t/a", prompt)
    sim.send(RetentionHold("t/a", later()))
    sim.poke()
    sim.send(RetentionDemote("t/a"))
    sim.poke()
    assert sim.channel.held == {}
    assert sim.channel.given_back()[-1] == GivenBack("t/a", 10, GiveBackReason.DEMOTED)
    assert sim.channel.reports[-1].host_used_blocks >= 10
    sim.flood(POOL)  # its GPU blocks went first: the flood takes them
    again = sim.turn("t/a", [*prompt, *tokens(9000, 40)])
    assert again.num_cached_tokens == again.num_host_cached_tokens == 10 * BS


def test_a_restore_brings_a_demoted_session_back_to_the_gpu_before_its_turn() -> None:
    """The twin hands a restore to its restorer (the worker's: the engine's prefetch from
    its host tier); the next turn then finds its prefix on the GPU, none of it loaded."""
    sim = Sim(host=4 * POOL)
    assert sim.retention is not None
    sim.retention.restorer = lambda r: sim.engine.restore(r.key, sim.now, 60.0)
    prompt = tokens(0, 10 * BS)
    sim.turn("t/a", prompt)
    sim.send(RetentionDemote("t/a"))
    sim.poke()
    sim.flood(POOL)  # its GPU blocks went first: the flood takes them
    sim.send(RetentionRestore("t/a", later()))
    sim.poke()  # the step applies it: the copy runs, and lands within the poke's steps
    again = sim.turn("t/a", [*prompt, *tokens(9000, 40)])
    assert again.num_cached_tokens == 10 * BS and again.num_host_cached_tokens == 0


def test_a_branchs_end_drops_its_own_blocks_from_the_host_tier_too() -> None:
    sim = Sim(host=4 * POOL)
    parent, own = tokens(0, 4 * BS), tokens(5000, 6 * BS)
    sim.turn("t/root", parent)
    sim.turn("t/kid", [*parent, *own])
    assert sim.engine.host is not None
    assert len(sim.engine.host) == 10  # every computed prompt block is stored there
    sim.send(RetentionEvictFirst("t/kid", keep_blocks=4, drop_host=True))
    sim.poke()  # a prompt of less than a block: it stores none
    assert len(sim.engine.host) == 4  # the parent's
    again = sim.turn("t/root", [*parent, *tokens(7000, 40)])
    assert again.num_cached_tokens == 4 * BS  # the inherited prefix still hits
