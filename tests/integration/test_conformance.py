"""The simulated worker and real vLLM 0.32 answer the same requests the same way.

Every test here runs the same code against both backends: the sim (a `ThreadedWorker` in
this process, serving the same tiny model directory's tokenizer, block size 32, sha256_cbor,
PYTHONHASHSEED "0" and the same number of KV blocks) and the real CPU server of the
`vllm_server` fixture. Each backend is held to one expectation: block hashes recomputed by
`appliance.domain.block_hash`, cached tokens derived from `/tokenize`, response key lists and
error fields recorded from vLLM 0.32. Two tests compare the backends with each other: metric
families, and the KV-event sequence of a scripted workload on a small cache with evictions,
for which a second real server is started. Token-id prompts are drawn per test and requests
carry a test-specific cache_salt, so tests sharing the session server do not meet in its
cache. Nothing looks at generated text.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.domain.block_hash import BlockHasher, RequestKeys, event_block_hash
from appliance.sim.entrypoints.serving import ThreadedWorker
from appliance.sim.runtime.worker import WorkerConfig
from tests.conftest import SESSION_KV_CACHE_BYTES, fail_without_traceback
from tests.vllm_server import KvEventSubscriber, RunningVllm, VllmServerError, running_vllm

pytestmark = pytest.mark.vllm

BLOCK = 32
MAX_MODEL_LEN = 4096  # tests/vllm_server.py's default
SMALL_KV_BYTES = 2 * 2**20  # 64 blocks of 32 tokens with the tiny model (1 KiB per token)
SMALL_MAX_MODEL_LEN = 1024
HASHER = BlockHasher.for_engine("sha256_cbor", BLOCK, "0")


@dataclass(frozen=True)
class Backend:
    name: str
    base_url: str
    model: str
    kv_events: KvEventSubscriber

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60.0)


def kv_bytes_per_token(model_dir: Path) -> int:
    """bf16 K and V of every layer: what vLLM sizes its cache blocks by."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2


def start_sim(
    model_dir: Path, kv_bytes: int, max_model_len: int
) -> tuple[ThreadedWorker, KvEventSubscriber]:
    """A sim worker shaped like a real server started with `kv_bytes` of KV cache; its KV
    events go to a freshly bound subscriber (the sim connects, as vLLM does)."""
    subscriber = KvEventSubscriber()
    config = WorkerConfig(
        served_model_name="tiny",
        model=str(model_dir),
        port=0,
        block_size=BLOCK,
        num_gpu_blocks=kv_bytes // (kv_bytes_per_token(model_dir) * BLOCK),
        max_model_len=max_model_len,
        hash_algo="sha256_cbor",
        python_hash_seed="0",
        kv_events_endpoint=subscriber.endpoint,
        time_scale=0.02,
        dev_mode=True,
    )
    worker = ThreadedWorker(config).start()
    _wait_for_events(worker.base_url, subscriber)
    return worker, subscriber


def _wait_for_events(base_url: str, subscriber: KvEventSubscriber) -> None:
    """Send one-block requests until an event arrives (a ZMQ subscription takes a moment),
    then empty the cache, so the sim starts as cold as a fresh server."""
    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        for attempt in range(50):
            body = {"prompt": list(range(4, 4 + BLOCK + 1)), "max_tokens": 1}
            client.post("/v1/completions", json={**body, "cache_salt": f"warmup-{attempt}"})
            if subscriber.receive(0.1) is not None:
                assert client.post("/reset_prefix_cache").json() == {"success": True}
                subscriber.drain(0.1)
                return
    raise AssertionError("the sim's KV events never reached the subscriber")


@pytest.fixture(scope="module")
def sim_backend(tiny_model_dir: Path) -> Iterator[Backend]:
    worker, subscriber = start_sim(tiny_model_dir, SESSION_KV_CACHE_BYTES, MAX_MODEL_LEN)
    try:
        yield Backend("sim", worker.base_url, "tiny", subscriber)
    finally:
        worker.stop()
        subscriber.close()


def real_backend(server: RunningVllm) -> Backend:
    return Backend("vllm", server.base_url, server.model, server.kv_events)


@pytest.fixture(params=["sim", "vllm"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "sim":
        sim: Backend = request.getfixturevalue("sim_backend")
        return sim
    return real_backend(request.getfixturevalue("vllm_server"))


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(n)]


def stored_events(backend: Backend, n_blocks: int, timeout_s: float = 10.0) -> list[dict]:
    """BlockStored events until they cover `n_blocks` blocks, then whatever else follows."""
    events: list[dict] = []
    got = 0
    for _ in range(int(timeout_s / 0.2)):
        if got >= n_blocks:
            break
        batch = backend.kv_events.receive(0.2)
        if batch is not None:
            stored = [e for e in batch.events if e["type"] == "BlockStored"]
            events += stored
            got += sum(len(e["block_hashes"]) for e in stored)
    return events


# --- KV events: the hashes and fields of the real engine ---


@pytest.mark.parametrize("salt_and_session", [(None, None), ("salt-conf", "sess-conf")])
def test_block_stored_events_equal_recomputed_ones(
    backend: Backend, salt_and_session: tuple[str | None, str | None]
) -> None:
    salt, session = salt_and_session
    prompt = token_prompt(101 if salt else 102, 3 * BLOCK + 5)
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    if salt:
        body["cache_salt"] = salt
    headers = {"X-Session-ID": session} if session else {}
    backend.kv_events.drain(0.1)
    with backend.client() as client:
        r = client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    events = stored_events(backend, 3)

    hashes = HASHER.hash_blocks(prompt, keys=RequestKeys(cache_salt=salt))
    expected = {
        "type": "BlockStored",
        "block_hashes": [event_block_hash(h) for h in hashes],
        "parent_block_hash": None,
        "token_ids": prompt[: 3 * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [[salt] if salt else None, None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    if session:
        expected["session_id"] = session
    assert events == [expected]


# --- usage: cached tokens over a multi-turn chat ---


WORDS = "router session prefix block token worker stream policy ledger budget"


def test_cached_tokens_rise_over_a_multi_turn_chat(backend: Backend) -> None:
    """Each turn re-sends the conversation with a fixed assistant reply and a new user
    message; the hit is the block-aligned prefix shared with the previous prompt."""
    rng = random.Random(7)
    words = WORDS.split()
    messages: list[dict[str, str]] = []
    previous: list[int] = []
    cached, expected = [], []
    with backend.client() as client:
        for turn in range(4):
            text = " ".join(rng.choice(words) for _ in range(40 + 10 * turn))
            messages.append({"role": "user", "content": text})
            ids = client.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
            body = {"model": "tiny", "messages": messages, "max_tokens": 3, "ignore_eos": True}
            usage = client.post(
                "/v1/chat/completions", json={**body, "cache_salt": "conf-multi-turn"}
            ).json()["usage"]
            assert usage["prompt_tokens"] == ids["count"]
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            shared = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(previous, ids["tokens"], strict=False))
                    if a != b
                ),
                min(len(previous), ids["count"]),
            )
            expected.append(min(shared, ids["count"] - 1) // BLOCK * BLOCK)
            previous = ids["tokens"]
            messages.append({"role": "assistant", "content": "noted"})
    assert cached == expected
    assert cached[0] == 0 and cached[-1] > cached[1] > 0


# --- response shapes ---

COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "service_tier"]
COMPLETION_KEYS += ["system_fingerprint", "usage", "kv_transfer_params", "ec_transfer_params"]
COMPLETION_KEYS += ["metrics"]
COMPLETION_CHOICE = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids"]
COMPLETION_CHOICE += ["prompt_logprobs", "prompt_token_ids", "routed_experts"]
CHAT_KEYS = [*COMPLETION_KEYS[:8], "prompt_logprobs", "prompt_token_ids", "prompt_text"]
CHAT_KEYS += COMPLETION_KEYS[8:]
CHAT_CHOICE = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids"]
CHAT_CHOICE += ["routed_experts"]
MODEL_CARD = ["id", "object", "created", "owned_by", "root", "parent", "max_model_len"]
MODEL_CARD += ["permission"]
MESSAGE = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"]
USAGE += ["completion_tokens_details"]
DETAILS = ["cached_tokens", "created_cache_tokens", "multimodal_tokens"]
EXTRAS = {
    "ignore_eos": True,
    "cache_salt": "conf-shapes",
    "priority": 0,
    "session_id": "s-shapes",
    "kv_transfer_params": {"do_remote_decode": False},
    "vllm_xargs": {"note": "x"},
    "return_token_ids": True,
}


def test_non_streamed_responses_have_vllms_fields(backend: Backend) -> None:
    prompt = token_prompt(5, 40)
    with backend.client() as client:
        cmpl = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4, **EXTRAS}
        ).json()
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": M, "max_tokens": 4, **EXTRAS},
        ).json()
        models = client.get("/v1/models").json()
    assert list(cmpl) == COMPLETION_KEYS and list(cmpl["choices"][0]) == COMPLETION_CHOICE
    assert list(cmpl["usage"]) == USAGE and list(cmpl["usage"]["prompt_tokens_details"]) == DETAILS
    assert cmpl["id"].startswith("cmpl-") and cmpl["object"] == "text_completion"
    assert cmpl["kv_transfer_params"] is None  # no KV connector: vLLM returns none
    assert cmpl["choices"][0]["prompt_token_ids"] == prompt
    assert len(cmpl["choices"][0]["token_ids"]) == cmpl["usage"]["completion_tokens"] == 4
    assert cmpl["choices"][0]["finish_reason"] == "length"
    assert cmpl["usage"]["prompt_tokens_details"]["created_cache_tokens"] is None
    assert list(chat) == CHAT_KEYS and list(chat["choices"][0]) == CHAT_CHOICE
    assert list(chat["choices"][0]["message"]) == MESSAGE
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])
    assert chat["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 0
    card = models["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == MAX_MODEL_LEN
    assert list(card) == MODEL_CARD


def sse_shapes(response: httpx.Response) -> tuple[list[tuple], list[dict]]:
    """Distinct consecutive chunk shapes (top keys, choice keys, delta keys) and chunks."""
    shapes: list[tuple] = []
    chunks: list[dict] = []
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        chunks.append(chunk)
        choice = chunk["choices"][0] if chunk["choices"] else {}
        shape = (tuple(chunk), tuple(choice), tuple(choice.get("delta", {})))
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
    return shapes, chunks


def test_streams_have_vllms_chunks(backend: Backend) -> None:
    head = ("id", "object", "created", "model", "choices")
    usage_chunk = ((*head, "usage", "system_fingerprint"), (), ())
    with backend.client() as client:
        body = {"model": "tiny", "max_tokens": 3, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        chat_body = {**body, "messages": [{"role": "user", "content": "hi"}]}
        with client.stream("POST", "/v1/chat/completions", json=chat_body) as r:
            chat_shapes, chat_chunks = sse_shapes(r)
        cmpl_body = {**body, "prompt": token_prompt(6, 20), "stream_options": None}
        with client.stream("POST", "/v1/completions", json=cmpl_body) as r:
            cmpl_shapes, cmpl_chunks = sse_shapes(r)
    delta_keys = ("index", "delta", "logprobs", "finish_reason")
    # vLLM sends the tokens that are ready when its stream is read next in one chunk: on a
    # busy machine the middle chunk can merge into the last, so it may be missing.
    assert chat_shapes[0] == (
        (*head, "prompt_token_ids", "prompt_text"),
        delta_keys,
        ("role", "content"),
    )
    assert set(chat_shapes[1:-2]) <= {(head, (*delta_keys, "token_ids"), ("content",))}
    assert chat_shapes[-2:] == [
        (head, (*delta_keys, "stop_reason", "token_ids"), ("content",)),
        usage_chunk,
    ]
    final = chat_chunks[-1]["usage"]
    assert final["completion_tokens"] == 3
    assert list(final["prompt_tokens_details"]) == ["cached_tokens", "created_cache_tokens"]
    text_keys = ("index", "text", "logprobs", "finish_reason", "stop_reason")
    text_keys += ("prompt_token_ids", "token_ids")
    assert cmpl_shapes[-1] == ((*head, "system_fingerprint"), text_keys, ())
    assert {s[1] for s in cmpl_shapes} == {text_keys}
    assert [c["choices"][0]["finish_reason"] for c in cmpl_chunks][-1] == "length"


# --- bad input: vLLM's statuses and error fields ---

M = [{"role": "user", "content": "hi"}]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
LONG_CHAT = [{"role": "user", "content": "hello world " * 3000}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def bad(case_id: str, path: str, body: Any, status: int, err_type: str, param: str | None) -> Any:
    """One bad request (bytes are sent raw as JSON) and vLLM 0.32's answer to it."""
    return pytest.param(path, body, status, err_type, param, id=case_id)


BR, VE, NF = "Bad Request", "BadRequestError", "NotFoundError"
BAD_INPUTS = [
    bad("malformed-json", CHAT, b'{"model": "tiny", "messages": [', 400, BR, "body.31"),
    bad("body-not-object", CMPL, b"[1, 2]", 400, BR, "body"),
    bad("unknown-model-chat", CHAT, {"model": "nope", "messages": M}, 404, NF, "model"),
    bad("unknown-model-cmpl", CMPL, {"model": "nope", "prompt": "hi"}, 404, NF, "model"),
    bad(
        "unknown-model-stream",
        CHAT,
        {"model": "x", "messages": M, "stream": True},
        404,
        NF,
        "model",
    ),
    bad("prompt-ids-too-long", CMPL, {"prompt": [5] * 5000}, 400, VE, "input_tokens"),
    bad("chat-too-long", CHAT, {"messages": LONG_CHAT}, 400, VE, "input_tokens"),
    bad(
        "prompt-fills-context", CMPL, {"prompt": [5] * 4096, "max_tokens": 1}, 400, VE, "max_tokens"
    ),
    bad("max-tokens-0", CMPL, {"prompt": [5, 6], "max_tokens": 0}, 400, VE, "max_tokens"),
    bad("max-tokens-negative", CHAT, {"messages": M, "max_tokens": -1}, 400, VE, "max_tokens"),
    bad(
        "max-completion-tokens-0",
        CHAT,
        {"messages": M, "max_completion_tokens": 0},
        400,
        VE,
        "max_tokens",
    ),
    bad(
        "max-tokens-string", CMPL, {"prompt": [5], "max_tokens": "ten"}, 400, BR, "body.max_tokens"
    ),
    bad("token-id-string", CMPL, {"prompt": [5, "a"]}, 400, BR, "body.prompt.1"),
    bad("token-id-float", CMPL, {"prompt": [5, 1.5]}, 400, BR, "body.prompt.1"),
    bad("token-id-negative", CMPL, {"prompt": [5, -1]}, 400, BR, "body.prompt.1"),
    bad("token-id-out-of-vocab", CMPL, {"prompt": [5, 999999]}, 400, VE, None),
    bad("empty-token-list", CMPL, {"prompt": []}, 400, VE, None),
    bad("prompt-missing", CMPL, {"max_tokens": 1}, 400, VE, "prompt"),
    bad("prompt-wrong-type", CMPL, {"prompt": 5}, 400, BR, "body.prompt"),
    bad("messages-not-list", CHAT, {"messages": "hi"}, 400, BR, "body.messages"),
    bad("messages-missing", CHAT, {"max_tokens": 1}, 400, BR, "body.messages"),
    bad("messages-empty", CHAT, {"messages": []}, 400, VE, None),
    bad(
        "temperature-string",
        CHAT,
        {"messages": M, "temperature": "hot"},
        400,
        BR,
        "body.temperature",
    ),
    bad(
        "stream-options-no-stream",
        CMPL,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        VE,
        "stream_options",
    ),
    bad("cache-salt-empty", CMPL, {"prompt": "x", "cache_salt": ""}, 400, VE, "cache_salt"),
    bad("session-id-int", CMPL, {"prompt": [5], "session_id": 5}, 400, BR, "body.session_id"),
    bad(
        "kv-transfer-params-list",
        CMPL,
        {"prompt": [5], "kv_transfer_params": [1]},
        400,
        BR,
        "body.kv_transfer_params",
    ),
    bad("tools-without-parser", CHAT, {"messages": M, "tools": [TOOL]}, 400, VE, None),
    bad(
        "tools-required",
        CHAT,
        {"messages": M, "tools": [TOOL], "tool_choice": "required"},
        400,
        VE,
        None,
    ),
    bad("tools-empty", CHAT, {"messages": M, "tools": []}, 400, VE, "tools"),
    bad(
        "tool-choice-without-tools",
        CHAT,
        {"messages": M, "tool_choice": "auto"},
        400,
        VE,
        "tool_choice",
    ),
    bad("tokenize-neither-form", "/tokenize", {"model": "tiny"}, 400, BR, "body.prompt"),
    bad("tokenize-unknown-model", "/tokenize", {"model": "nope", "prompt": "x"}, 404, NF, "model"),
    bad("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, BR, "body.tokens.0"),
]


@pytest.mark.parametrize(("path", "body", "status", "err_type", "param"), BAD_INPUTS)
def test_bad_input_gets_vllms_error(
    backend: Backend, path: str, body: Any, status: int, err_type: str, param: str | None
) -> None:
    with backend.client() as client:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert (error["type"], error["code"], error["param"]) == (err_type, status, param)
    assert isinstance(error["message"], str) and error["message"]


def test_wrong_content_type_is_rejected(backend: Backend) -> None:
    with backend.client() as client:
        r = client.post(CMPL, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        missing = client.get("/v1/nothing")
        wrong_method = client.get(CMPL)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "Bad Request" and r.json()["error"]["param"] is None
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert (wrong_method.status_code, wrong_method.json()) == (
        405,
        {"detail": "Method Not Allowed"},
    )


# --- the two backends side by side ---

_FAMILY = re.compile(r"^# TYPE (vllm:\S+) (\S+)$", re.M)
_SAMPLE = re.compile(r"^(vllm:[^{ ]+)\{([^}]*)\}", re.M)


def metric_shape(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Family -> type, and metric name -> label names, of the `vllm:` metrics."""
    labels: dict[str, set[str]] = {}
    for name, inner in _SAMPLE.findall(text):
        labels.setdefault(name, set()).update(re.findall(r'(\w+)="', inner))
    return dict(_FAMILY.findall(text)), labels


def cache_config(text: str) -> dict[str, str]:
    line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def test_metrics_have_the_same_families_labels_and_cache_shape(
    sim_backend: Backend, vllm_server: RunningVllm
) -> None:
    real = real_backend(vllm_server)
    texts = {}
    for b in (sim_backend, real):
        with b.client() as client:
            client.post(CMPL, json={"prompt": token_prompt(9, 70), "max_tokens": 2})
            texts[b.name] = client.get("/metrics").text
    assert metric_shape(texts["sim"]) == metric_shape(texts["vllm"])
    same = ("block_size", "num_gpu_blocks", "prefix_caching_hash_algo", "enable_prefix_caching")
    sim_cc, real_cc = cache_config(texts["sim"]), cache_config(texts["vllm"])
    assert {k: sim_cc[k] for k in same} == {k: real_cc[k] for k in same}
    assert set(sim_cc) == set(real_cc)


@pytest.fixture(scope="module")
def small_pair(
    vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Backend, Backend, RunningVllm]]:
    """A real server and a sim with a 64-block cache, for a workload that evicts."""
    workdir = tmp_path_factory.mktemp("vllm-small")
    worker, subscriber = start_sim(tiny_model_dir, SMALL_KV_BYTES, SMALL_MAX_MODEL_LEN)
    try:
        with running_vllm(
            tiny_model_dir,
            workdir,
            python=vllm_python,
            kv_cache_memory_bytes=SMALL_KV_BYTES,
            max_model_len=SMALL_MAX_MODEL_LEN,
        ) as server:
            yield Backend("sim", worker.base_url, "tiny", subscriber), real_backend(server), server
    except VllmServerError as exc:
        fail_without_traceback(exc)
    finally:
        worker.stop()
        subscriber.close()


def run_eviction_workload(backend: Backend) -> list[tuple[int, list[tuple]]]:
    """Prompts that share prefixes and overflow 63 usable blocks; per request its cached
    tokens and the KV events it caused (type and hashes, in order)."""
    a, b, c, d = (token_prompt(s, 24 * BLOCK) for s in (11, 12, 13, 14))
    script = [
        a[: 20 * BLOCK + 5],
        a[: 10 * BLOCK] + b[: 12 * BLOCK + 3],
        c[: 22 * BLOCK + 9],
        a[: 20 * BLOCK + 5],  # partly evicted by now
        d[: 24 * BLOCK],
        a[: 10 * BLOCK] + b[: 12 * BLOCK + 3],
        c[: 5 * BLOCK] + d[: 15 * BLOCK + 1],
    ]
    backend.kv_events.drain(0.2)
    results = []
    with backend.client() as client:
        for prompt in script:
            body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True}
            usage = client.post(CMPL, json=body).json()["usage"]
            events = [
                (e["type"], e["block_hashes"], e.get("parent_block_hash"))
                for batch in backend.kv_events.drain(0.4)
                for e in batch.events
            ]
            results.append((usage["prompt_tokens_details"]["cached_tokens"], events))
    return results


def test_eviction_workload_emits_the_same_event_sequence(
    small_pair: tuple[Backend, Backend, RunningVllm],
) -> None:
    sim, real, server = small_pair
    assert server.kv_cache_tokens == SMALL_KV_BYTES // 1024, "the sim assumes 1 KiB per token"
    sim_run, real_run = run_eviction_workload(sim), run_eviction_workload(real)
    assert any(kind == "BlockRemoved" for _, events in real_run for kind, *_ in events)
    assert [cached for cached, _ in sim_run] == [cached for cached, _ in real_run]
    assert sim_run == real_run
