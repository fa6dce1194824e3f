"""The ports `appliance up` settles before it starts anything: engine ports left unset follow
the API's port, or are chosen free where those are taken; the API's port and the configured
ones are checked together, and one error names every port of them in use."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from appliance.config.settings import PORT_OFFSETS, Settings
from appliance.config.settings_load import load
from appliance.engines.errors import PortInUse
from appliance.engines.supervision.port_plan import planned_ports
from tests.ports import free_port, free_port_block, port_is_free


def api_port_with_free_followers(workers: int) -> int:
    """An API port whose followed engine blocks are free too."""
    for _ in range(200):
        port = free_port()
        blocks = [port + offset for offset in PORT_OFFSETS.values()]
        if all(port_is_free(b + i) for b in blocks for i in range(workers)):
            return port
    raise RuntimeError("no API port with free followers")


@contextmanager
def taken(*ports: int) -> Iterator[None]:
    with ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
            sock.listen()
        yield


def engine_ports(settings: Settings) -> list[int | None]:
    e = settings.engine
    return [e.base_port, e.kv_events_base_port, e.kv_retention_base_port]


def test_unset_ports_follow_the_api_port() -> None:
    port = api_port_with_free_followers(2)
    planned = planned_ports(load(server={"port": port}, engine={"workers": 2}))
    assert engine_ports(planned) == [port + 20, port - 2523, port - 2423]


def test_a_followed_block_that_is_taken_is_chosen_free_elsewhere() -> None:
    port = api_port_with_free_followers(2)
    with taken(port + 21):  # the second worker's HTTP port (another appliance's, say)
        planned = planned_ports(load(server={"port": port}, engine={"workers": 2}))
        base = planned.engine.base_port
        assert base is not None and base != port + 20
        assert port_is_free(base) and port_is_free(base + 1)
    assert engine_ports(planned)[1:] == [port - 2523, port - 2423]


def test_set_ports_stay_and_every_one_in_use_is_named_at_once() -> None:
    api, base, kv = free_port(), free_port_block(2), free_port_block(2)
    engine = {"workers": 2, "base_port": base, "kv_events_base_port": kv}
    settings = load(server={"port": api}, engine=engine)
    assert engine_ports(planned_ports(settings))[:2] == [base, kv]
    with taken(api, base + 1, kv), pytest.raises(PortInUse) as err:
        planned_ports(settings)
    message = err.value.message
    assert message.startswith(
        f"3 ports are in use: 127.0.0.1:{api} (the API), 127.0.0.1:{base + 1} (HTTP of worker "
        f"w1), 127.0.0.1:{kv} (KV events of worker w0); stop what listens there or "
    )
    assert message.endswith(
        "pass another --port and choose another engine.base_port and choose another "
        "engine.kv_events_base_port"
    )
    assert err.value.exit_code == 2


def test_set_blocks_that_overlap_are_refused() -> None:
    base = free_port_block(3)
    settings = load(engine={"workers": 2, "base_port": base, "kv_events_base_port": base + 1})
    with pytest.raises(PortInUse, match="overlap for 2 workers"):
        planned_ports(settings)


def test_external_workers_need_only_the_api_port_and_plain_ones_no_retention_port() -> None:
    engine = {"kind": "external", "external_urls": ["http://127.0.0.1:1"]}
    external = load(engine=engine, server={"port": free_port()})
    assert engine_ports(planned_ports(external)) == [None, None, None]
    port = api_port_with_free_followers(1)
    plain = planned_ports(load(server={"port": port}, engine={"kv_retention": False}))
    assert engine_ports(plain) == [port + 20, port - 2523, None]
