"""The retention control channel over real ZMQ sockets, without vLLM: the appliance's client
(a ROUTER per worker) and the connector's channel (a DEALER on its own thread), as the
supervisor and a worker's scheduler use them. Takes about a second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
import zmq

from appliance.domain.records import WorkerId
from appliance.engines.retention.channel import ControlChannel
from appliance.engines.retention.client import RetentionClient
from appliance.engines.retention.protocol import (
    GiveBackReason,
    GivenBack,
    HeldKv,
    RetentionEvictFirst,
    RetentionHold,
    RetentionOrder,
    RetentionRelease,
    RetentionReport,
)
from tests.ports import free_port_block

W0, W1 = WorkerId("w0"), WorkerId("w1")


def hello(incarnation: str) -> RetentionReport:
    return RetentionReport(incarnation, 0, time.time(), 0, 0)


def holding(incarnation: str, *keys: str, gave: tuple[GivenBack, ...] = ()) -> RetentionReport:
    held = tuple(HeldKv(k, 4, 128, time.time() + 60, 0.0) for k in keys)
    return RetentionReport(incarnation, 0, time.time(), 100, 50, held, gave)


def with_client(body: Callable[[RetentionClient], Awaitable[None]]) -> None:
    """Runs `body` on a fresh event loop with a client bound for two workers."""

    async def main() -> None:
        base = free_port_block(2)
        c = RetentionClient({W0: f"tcp://127.0.0.1:{base}", W1: f"tcp://127.0.0.1:{base + 1}"})
        c.bind()
        try:
            await asyncio.wait_for(body(c), 30)
        finally:
            await c.aclose()

    asyncio.run(main())


def channel(client: RetentionClient, worker: WorkerId, incarnation: str, **kw) -> ControlChannel:
    return ControlChannel(client.endpoints[worker], hello(incarnation), **kw).start()


async def next_directive(ch: ControlChannel, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while ch.directives.empty():
        assert time.monotonic() < deadline, "no directive arrived"
        await asyncio.sleep(0.01)
    return ch.directives.get_nowait()


def test_directives_reach_the_worker_that_said_hello() -> None:
    with_client(_directives_reach_the_worker_that_said_hello)


async def _directives_reach_the_worker_that_said_hello(client: RetentionClient) -> None:
    assert not await client.hold(W0, "t/a", time.time() + 60)  # nobody there yet
    ch = channel(client, W0, "100-aaaa")
    try:
        view = await client.wait_for(W0, lambda v: v.incarnation == "100-aaaa", 5)
        assert view.report is not None and view.report.seq == 0 and view.held == {}
        assert view.restarts == 0 and client.view(W1).incarnation is None
        sent = [
            RetentionHold("t/a", 1e10, 2.0),
            RetentionRelease("t/a"),
            RetentionEvictFirst("t/b"),
            RetentionOrder({"t/c": 1.0}),
        ]
        assert await client.hold(W0, "t/a", 1e10, 2.0)
        assert await client.release(W0, "t/a")
        assert await client.evict_first(W0, "t/b")
        assert await client.order(W0, {"t/c": 1.0})
        assert [await next_directive(ch) for _ in sent] == sent
    finally:
        ch.close()


def test_reports_update_the_view_in_order() -> None:
    with_client(_reports_update_the_view_in_order)


async def _reports_update_the_view_in_order(client: RetentionClient) -> None:
    ch = channel(client, W1, "200-bbbb")
    seen: list[RetentionReport] = []

    async def record() -> None:
        async for worker, report in client.reports():
            assert worker == W1
            seen.append(report)

    recorder = asyncio.create_task(record())
    try:
        gave = (GivenBack("t/x", 3, GiveBackReason.EXPIRED),)
        ch.publish(holding("200-bbbb", "t/a"))
        ch.publish(holding("200-bbbb", "t/a", "t/b", gave=gave))
        view = await client.wait_for(W1, lambda v: len(v.held) == 2, 5)
        assert view.held == {"t/a": 4, "t/b": 4}
        await asyncio.sleep(0.05)
        assert [r.seq for r in seen] == [0, 1, 2]
        assert [r.given_back for r in seen] == [(), (), gave]
        assert await client.query(W1)  # answered at once with the state, nothing given back
        await client.wait_for(W1, lambda v: v.report is not None and v.report.seq == 3, 5)
        assert client.view(W1).held == {"t/a": 4, "t/b": 4}
        assert client.view(W1).report.given_back == ()  # type: ignore[union-attr]
    finally:
        recorder.cancel()
        ch.close()


def test_a_quiet_worker_still_reports_every_interval() -> None:
    with_client(_a_quiet_worker_still_reports_every_interval)


async def _a_quiet_worker_still_reports_every_interval(client: RetentionClient) -> None:
    ch = channel(client, W0, "300-cccc", report_interval_s=0.1)
    try:
        await client.wait_for(W0, lambda v: v.report is not None and v.report.seq >= 3, 5)
    finally:
        ch.close()


def test_a_restarted_worker_holds_nothing_and_says_so() -> None:
    with_client(_a_restarted_worker_holds_nothing_and_says_so)


async def _a_restarted_worker_holds_nothing_and_says_so(client: RetentionClient) -> None:
    old = channel(client, W0, "400-old")
    old.publish(holding("400-old", "t/a"))
    await client.wait_for(W0, lambda v: "t/a" in v.held, 5)
    old.close()
    client.forget(W0)  # the supervisor saw the process exit
    view = client.view(W0)
    assert (view.incarnation, view.held) == (None, {})
    assert not await client.hold(W0, "t/a", 1e10)
    new = channel(client, W0, "401-new")
    try:
        view = await client.wait_for(W0, lambda v: v.incarnation == "401-new", 5)
        assert view.restarts == 1 and view.held == {}
        assert view.report is not None and view.report.seq == 0
        assert await client.hold(W0, "t/a", 1e10)
        assert await next_directive(new) == RetentionHold("t/a", 1e10)
    finally:
        new.close()


def test_a_late_report_from_an_exited_worker_is_ignored() -> None:
    with_client(_a_late_report_from_an_exited_worker_is_ignored)


async def _a_late_report_from_an_exited_worker_is_ignored(client: RetentionClient) -> None:
    old = channel(client, W0, "500-old")
    await client.wait_for(W0, lambda v: v.incarnation == "500-old", 5)
    client.forget(W0)
    old.publish(holding("500-old", "t/ghost"))
    await asyncio.sleep(0.2)
    old.close()
    assert client.view(W0).incarnation is None and client.view(W0).held == {}


def test_undecodable_messages_are_dropped_on_both_sides() -> None:
    with_client(_undecodable_messages_are_dropped_on_both_sides)


async def _undecodable_messages_are_dropped_on_both_sides(client: RetentionClient) -> None:
    ch = channel(client, W0, "600-dddd")
    try:
        await client.wait_for(W0, lambda v: v.incarnation == "600-dddd", 5)
        sock = client._sockets[W0]  # a directive nobody can decode
        await sock.send_multipart([b"600-dddd", b"\x00not msgpack"], flags=zmq.NOBLOCK)
        assert await client.release(W0, "t/a")
        assert await next_directive(ch) == RetentionRelease("t/a")  # the channel lives on
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.connect(client.endpoints[W0])
        rogue.send(msgspec.msgpack.encode({"type": "report", "seq": "x"}))
        rogue.close(linger=500)
        ch.publish(holding("600-dddd", "t/b"))
        await client.wait_for(W0, lambda v: "t/b" in v.held, 5)  # the client lives on
    finally:
        ch.close()


def test_the_port_shows_what_each_worker_holds_and_gives_back() -> None:
    with_client(_the_port_shows_what_each_worker_holds_and_gives_back)


async def _the_port_shows_what_each_worker_holds_and_gives_back(client: RetentionClient) -> None:
    assert client.controls and client.retained(W0) == {} and client.kv_usage(W0) is None
    returned = client.returned()
    ch = channel(client, W0, "700-eeee")
    try:
        gave = (GivenBack("t/old", 3, GiveBackReason.PRESSURE),)
        ch.publish(holding("700-eeee", "t/a", gave=gave))
        first = await asyncio.wait_for(anext(returned), 5)
        assert (first.worker, first.key, first.blocks, first.reason) == (W0, "t/old", 3, "pressure")
        held = client.retained(W0)
        assert list(held) == ["t/a"] and held["t/a"].tokens == 128
        assert client.retained(W0) is held  # built once per report
        assert client.kv_usage(W0) == 0.5  # 50 of 100 blocks free
        assert client.retained(W1) == {} and client.kv_usage(W1) is None
    finally:
        ch.close()
