"""KV events over real ZMQ sockets: the sim's publisher, the engine subscriber, vLLM's bytes."""

from __future__ import annotations

import json
import subprocess
import time

import msgspec
import pytest

from appliance.domain import kv_events as ev
from appliance.engines.clients.kv_events import KvEventSubscriber, decode_batch, decode_event
from appliance.sim.kv.kv_publisher import KvEventPublisher, encode_batch
from tests.ports import free_port

STORED = ev.BlockStored(
    block_hashes=(1, 2**64 - 1),
    parent_block_hash=None,
    token_ids=tuple(range(32)),
    block_size=16,
    extra_keys=(None, None),
    group_idx=0,
    kv_cache_spec_kind="full_attention",
    session_id="s-1",
)
REMOVED = ev.BlockRemoved(block_hashes=(2**64 - 1,), group_idx=0)


def test_round_trip_over_a_real_socket() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    got: list[ev.KvEventBatch] = []
    sub = KvEventSubscriber(endpoint, got.append).start()  # binds: vLLM connects to tcp
    pub = KvEventPublisher(endpoint)
    try:
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:  # ZMQ slow joiner: resend until seen
            pub.publish([STORED])
            time.sleep(0.05)
        pub.publish([REMOVED, ev.AllBlocksCleared()])
        while len({b.seq for b in got}) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sub.close()
        pub.close()
    assert got[0].events == (STORED,)
    assert got[-1].events == (REMOVED, ev.AllBlocksCleared())
    assert got[-1].data_parallel_rank == 0


def test_gap_is_filled_from_the_replay_socket() -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay)
    seen: list[int] = []
    resets: list[str] = []
    sub = KvEventSubscriber(
        f"tcp://127.0.0.1:{free_port()}",
        lambda b: seen.append(b.seq),
        on_reset=resets.append,
        replay_endpoint=replay,
    )
    try:
        payloads = [encode_batch([STORED], 1.0) for _ in range(3)]
        for _ in payloads:
            pub.publish([STORED])  # seqs 0, 1, 2 land in the replay buffer
        sub._accept(decode_batch(b"", (0).to_bytes(8, "big"), payloads[0]))
        sub._accept(decode_batch(b"", (2).to_bytes(8, "big"), payloads[2]))
    finally:
        sub.close()
        pub.close()
    assert seen == [0, 1, 2]
    assert (sub.gaps_filled, sub.gaps_lost, resets) == (1, 0, [])


def test_unfillable_gap_and_restart_reset_the_worker() -> None:
    resets: list[str] = []
    sub = KvEventSubscriber(
        f"tcp://127.0.0.1:{free_port()}", lambda b: None, on_reset=resets.append
    )
    payload = encode_batch([STORED], 1.0)
    try:
        for seq in (0, 1, 5, 0):
            sub._accept(decode_batch(b"", seq.to_bytes(8, "big"), payload))
    finally:
        sub.close()
    assert sub.gaps_lost == 1 and sub.resets == 1
    assert resets == ["lost KV events 2..4", "engine restarted: sequence went back"]


def test_array_encoded_events_of_older_releases_decode() -> None:
    raw = [
        "BlockStored",
        [b"\x00" * 24 + (7).to_bytes(8, "big")],
        None,
        [1, 2],
        2,
        None,
        "GPU",
        None,
    ]
    stored = decode_event(raw)
    assert isinstance(stored, ev.BlockStored)
    assert stored.block_hashes == (7,) and stored.token_ids == (1, 2) and stored.medium == "GPU"
    assert decode_event(["BlockRemoved", [-1], "GPU"]) == ev.BlockRemoved((2**64 - 1,), "GPU")
    assert decode_event({"type": "SomethingNew", "x": 1}) is None


_VLLM_ENCODE = """
import json, sys, msgspec
from vllm.distributed.kv_events import BlockStored, BlockRemoved, AllBlocksCleared, EventBatch
events = [
    BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=list(range(32)),
                block_size=16, lora_id=None, medium="GPU", lora_name=None,
                extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention",
                session_id="s-1"),
    BlockRemoved(block_hashes=[2**64 - 1], medium="GPU", group_idx=0),
    AllBlocksCleared(),
]
sys.stdout.write(msgspec.msgpack.encode(EventBatch(ts=1.5, events=events,
                                                   data_parallel_rank=0)).hex())
"""


@pytest.mark.vllm
def test_bytes_equal_vllms_own_encoder(vllm_python: str) -> None:
    r = subprocess.run(
        [vllm_python, "-c", _VLLM_ENCODE], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = bytes.fromhex(r.stdout.strip())
    ours = encode_batch([STORED, REMOVED, ev.AllBlocksCleared()], 1.5, 0)
    assert ours == theirs, json.dumps(
        [msgspec.msgpack.decode(ours), msgspec.msgpack.decode(theirs)], default=str
    )
