"""The retention control channel's messages on the wire, and what a worker's command line
carries to the connector."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

import appliance
from appliance.engines.retention.plugin import (
    RetentionLaunch,
    RetentionTuning,
    plugin_path,
)
from appliance.engines.retention.protocol import (
    GiveBackReason,
    GivenBack,
    HeldKv,
    RetentionDirective,
    RetentionEvictFirst,
    RetentionHold,
    RetentionOrder,
    RetentionQuery,
    RetentionRelease,
    RetentionReport,
    RetentionRestore,
    decode_directive,
    decode_report,
    encode_retention,
)

DIRECTIVES: list[RetentionDirective] = [
    RetentionHold("acme/s-1", 1_800_000_000.5, 0.25),
    RetentionHold("acme/s-1", 1_800_000_000.0),
    RetentionRelease("acme/s-1"),
    RetentionEvictFirst("acme/s-2"),
    RetentionOrder({"acme/s-1": 1.0, "acme/s-3": -2.5}),
    RetentionRestore("acme/s-4", 1_800_000_060.0, 0.5),
    RetentionQuery(),
]


@pytest.mark.parametrize("directive", DIRECTIVES, ids=lambda d: type(d).__name__)
def test_directives_round_trip(directive: RetentionDirective) -> None:
    assert decode_directive(encode_retention(directive)) == directive


def test_a_directive_names_its_kind_on_the_wire() -> None:
    raw = msgspec.msgpack.decode(encode_retention(RetentionHold("k", 5.0, 1.0)))
    assert raw == {"type": "hold", "key": "k", "until_s": 5.0, "priority": 1.0}
    assert (
        msgspec.msgpack.decode(encode_retention(RetentionEvictFirst("k")))["type"] == "evict_first"
    )


def test_a_report_round_trips_with_what_it_holds_and_gave_back() -> None:
    report = RetentionReport(
        incarnation="123-abcd",
        seq=7,
        at_s=1_800_000_000.0,
        pool_blocks=255,
        free_blocks=100,
        held=(HeldKv("acme/s-1", 47, 1504, 1_800_000_060.0, 0.5), HeldKv("b", 3, 96, 1.0, 0)),
        given_back=(GivenBack("acme/s-2", 12, GiveBackReason.PRESSURE),),
    )
    back = decode_report(encode_retention(report))
    assert back == report and back.held_blocks == 50
    assert back.given_back[0].reason is GiveBackReason.PRESSURE


@pytest.mark.parametrize(
    "data",
    [
        b"\x00garbage",
        msgspec.msgpack.encode({"type": "nuke", "key": "k"}),
        msgspec.msgpack.encode({"type": "hold", "key": "k"}),  # no until_s
        encode_retention(RetentionReport("i", 0, 0.0, 0, 0)),  # a report is no directive
    ],
)
def test_anything_else_is_refused(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_directive(data)


def test_the_tuning_travels_in_the_extra_config_and_back() -> None:
    tuning = RetentionTuning("tcp://127.0.0.1:5657", 0.5, 0.1, 2.0)
    assert RetentionTuning.from_extra(tuning.extra_config()) == tuning
    assert RetentionTuning.from_extra(None) == RetentionTuning()
    assert RetentionTuning.from_extra({"control_endpoint": ""}).control_endpoint is None


def test_worker_i_gets_port_base_plus_i() -> None:
    launch = RetentionLaunch(7000, tuning=RetentionTuning(max_held_fraction=0.5))
    extra = launch.kv_transfer_config(3)["kv_connector_extra_config"]
    assert extra["control_endpoint"] == launch.endpoint(3) == "tcp://127.0.0.1:7003"
    assert extra["max_held_fraction"] == 0.5


@pytest.mark.parametrize(
    ("python_path", "current", "expected"),
    [(None, "/x", "/x"), (None, None, None), ("/p", None, "/p"), ("/p", "/x:/y", "/p:/x:/y")],
)
def test_the_plugin_directory_goes_first_on_the_pythonpath(
    python_path: str | None, current: str | None, expected: str | None
) -> None:
    assert RetentionLaunch(1, python_path=python_path).pythonpath(current) == expected


def test_the_plugin_directory_holds_only_this_appliance(tmp_path: Path) -> None:
    package = Path(appliance.__file__).resolve().parent
    target = tmp_path / "plugin"
    target.mkdir()
    (target / "appliance").symlink_to(tmp_path)  # a stale link is replaced
    assert plugin_path(target) == target
    assert plugin_path(target) == target  # and again: nothing changes
    assert [p.name for p in target.iterdir()] == ["appliance"]
    assert (target / "appliance").resolve() == package
    assert (target / "appliance" / "engines" / "retention" / "connector.py").is_file()
