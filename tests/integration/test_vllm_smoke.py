"""Smoke tests against one real vLLM CPU server serving the tiny random model.

They pin down the engine behaviour the appliance relies on: health, usage accounting, prefix
caching, KV events over ZMQ, block hashes and Prometheus metrics. The weights are random, so
nothing here looks at generated text.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import cbor2
import httpx
import pytest

from tests.vllm_server import RunningVllm

pytestmark = pytest.mark.vllm

FILLER = """
    agent router session prefix cache block token worker request stream policy ledger budget
    latency queue batch model prompt reply tool call result error retry window memory engine
    event store evict hash parent child turn history summary plan step
"""
WORDS = tuple(FILLER.split())


def prose(seed: int, n_words: int) -> str:
    """Deterministic filler text, about 2.5 tokens a word with the tiny tokenizer."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def client(vllm_server: RunningVllm) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_server.base_url, timeout=60.0) as c:
        yield c


def chat(client: httpx.Client, text: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
        **extra,
    }
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return dict(response.json())


def chat_prompt_ids(client: httpx.Client, text: str) -> list[int]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "add_generation_prompt": True,
    }
    response = client.post("/tokenize", json=body)
    response.raise_for_status()
    return list(response.json()["tokens"])


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def stored_blocks(server: RunningVllm, n_tokens: int, timeout_s: float = 10.0) -> list[dict]:
    """BlockStored events until they cover ``n_tokens`` tokens (or the timeout passes)."""
    events: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(e["token_ids"]) for e in events) < n_tokens and time.monotonic() < deadline:
        batch = server.kv_events.receive(timeout_s=0.2)
        if batch is not None:
            events += [e for e in batch.events if e["type"] == "BlockStored"]
    return events


def test_health(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200


def test_streamed_chat_completion_reports_exact_usage(client: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prose(1, 20)}],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] > 20
    assert any(c["choices"] and c["choices"][0]["delta"] for c in chunks[:-1])


def test_cached_tokens_rise_over_a_multi_turn_session(
    client: httpx.Client, vllm_server: RunningVllm
) -> None:
    """Each turn re-sends the previous prompt plus ~100 tokens; the shared whole blocks hit."""
    block = vllm_server.block_size
    text = prose(2, 120)
    previous: list[int] = []
    cached, expected = [], []
    for turn in range(4):
        if turn:
            text += " " + prose(100 + turn, 40)
        ids = chat_prompt_ids(client, text)
        shared = shared_prefix_len(previous, ids)
        usage = chat(client, text, max_tokens=8, ignore_eos=True)["usage"]
        assert usage["prompt_tokens"] == len(ids)
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        # The template's assistant suffix differs between turns, so the hit stops before it.
        expected.append(shared // block * block)
        previous = ids
    assert cached[0] == 0
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    assert cached == expected


def test_block_stored_events_carry_the_prompt_tokens(
    client: httpx.Client, vllm_server: RunningVllm
) -> None:
    text = prose(3, 150)
    ids = chat_prompt_ids(client, text)
    full = len(ids) // vllm_server.block_size * vllm_server.block_size
    vllm_server.kv_events.drain()
    assert chat(client, text)["usage"]["prompt_tokens"] == len(ids)

    events = stored_blocks(vllm_server, full)
    assert events, "no BlockStored event within 10 s"
    token_ids = [t for e in events for t in e["token_ids"]]
    assert token_ids == ids[:full]
    assert events[0]["parent_block_hash"] is None
    for prev, event in itertools.pairwise(events):
        assert event["parent_block_hash"] == prev["block_hashes"][-1]
    for event in events:
        assert event["block_size"] == vllm_server.block_size
        assert len(event["block_hashes"]) * event["block_size"] == len(event["token_ids"])


def test_block_hashes_are_reproducible_outside_vllm(
    client: httpx.Client, vllm_server: RunningVllm
) -> None:
    """sha256_cbor with PYTHONHASHSEED=0: the published 64-bit hash is the digest's low 8 bytes."""
    text = prose(4, 60)
    ids = chat_prompt_ids(client, text)
    vllm_server.kv_events.drain()
    chat(client, text)
    events = stored_blocks(vllm_server, len(ids) // vllm_server.block_size * vllm_server.block_size)
    published = [h for e in events for h in e["block_hashes"]]
    assert published

    def sha256_cbor(value: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    parent, expected = sha256_cbor("0"), []  # NONE_HASH is derived from PYTHONHASHSEED
    block = vllm_server.block_size
    for start in range(0, len(published) * block, block):
        parent = sha256_cbor((parent, tuple(ids[start : start + block]), None))
        expected.append(int.from_bytes(parent, "big") & (2**64 - 1))
    assert published == expected


def test_metrics_expose_prefix_cache_and_kv_usage(client: httpx.Client) -> None:
    chat(client, prose(5, 30))
    metrics = client.get("/metrics").text
    assert "vllm:prefix_cache_queries_total" in metrics
    assert "vllm:kv_cache_usage_perc" in metrics
    queries = [
        line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_queries_total{")
    ]
    assert queries and float(queries[0].rsplit(" ", 1)[1]) > 0
