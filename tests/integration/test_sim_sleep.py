"""The simulated worker's sleep mode over real HTTP and ZMQ, as vLLM 0.32's with dev mode:
/sleep at level 1 and 2 drops the KV cache (AllBlocksCleared on the wire, no cached prompt
tokens after the wake), /is_sleeping and vllm:engine_sleep_state say so, a request sent
while asleep is held until the wake and then served, and the wake takes the configured
time. Wake times are lower bounds only: a wake never ends before its modelled time."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from appliance.domain import kv_events as ev
from appliance.engines.clients.kv_events import KvEventSubscriber
from appliance.engines.clients.metrics import parse
from appliance.sim.entrypoints.serving import ThreadedWorker
from appliance.sim.runtime.endpoints import free_port
from appliance.sim.runtime.worker import WorkerConfig

WAKE_S = (0.3, 0.6)


class Cleared:
    """Counts AllBlocksCleared events the worker publishes."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.count = 0
        self._lock = threading.Lock()
        self.sub = KvEventSubscriber(self.endpoint, self._on_batch).start()

    def _on_batch(self, batch: ev.KvEventBatch) -> None:
        with self._lock:
            self.count += sum(isinstance(e, ev.AllBlocksCleared) for e in batch.events)


@pytest.fixture(scope="module")
def cleared() -> Iterator[Cleared]:
    c = Cleared()
    yield c
    c.sub.close()


@pytest.fixture(scope="module")
def url(cleared: Cleared) -> Iterator[str]:
    config = WorkerConfig(
        port=0,
        block_size=16,
        time_scale=1.0,
        dev_mode=True,
        wake_s=WAKE_S,
        kv_events_endpoint=cleared.endpoint,
    )
    with ThreadedWorker(config) as worker:
        yield worker.base_url


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def sleep_state(url: str) -> dict[str, float]:
    scrape = parse(httpx.get(f"{url}/metrics").text)
    return scrape.by_label("vllm:engine_sleep_state", "sleep_state")


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.parametrize(("level", "gauge"), [(1, "weights_offloaded"), (2, "discard_all")])
def test_sleep_drops_the_kv_and_a_wake_serves_again(
    url: str, cleared: Cleared, level: int, gauge: str
) -> None:
    prompt = [random.Random(level).randrange(10, 5000) for _ in range(64)]
    complete(url, prompt)
    assert cached_tokens(complete(url, prompt)) >= 48  # cached while awake
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    before = cleared.count

    r = httpx.post(f"{url}/sleep", params={"level": level})
    assert r.json() == {"status": "sleeping", "level": level}
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_state(url) == {
        "awake": 0.0,
        "weights_offloaded": float(level == 1),
        "discard_all": float(level == 2),
    }
    assert sleep_state(url)[gauge] == 1.0
    wait_for(lambda: cleared.count == before + 1)  # the KV cache went with the sleep

    started = time.monotonic()
    r = httpx.post(f"{url}/wake_up", timeout=10)
    assert r.json() == {"status": "awake", "tags": None}
    assert time.monotonic() - started >= WAKE_S[level - 1]
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_state(url) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert cached_tokens(complete(url, prompt)) == 0  # nothing survived the sleep


def test_a_request_to_a_sleeping_worker_waits_for_the_wake(url: str) -> None:
    assert httpx.post(f"{url}/sleep", params={"level": 1}).status_code == 200
    answers: list[dict] = []
    sender = threading.Thread(target=lambda: answers.append(complete(url, [5, 6, 7, 8])))
    sender.start()
    sender.join(0.5)
    assert sender.is_alive() and not answers  # held, not refused
    assert httpx.post(f"{url}/wake_up", timeout=10).status_code == 200
    sender.join(10)
    assert answers and answers[0]["usage"]["completion_tokens"] == 2


def test_bad_sleep_levels_are_refused_as_fastapi_does(url: str) -> None:
    r = httpx.post(f"{url}/sleep", params={"level": 3})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "level"]
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_routes_need_dev_mode() -> None:
    with ThreadedWorker(WorkerConfig(port=0)) as worker:
        assert httpx.post(f"{worker.base_url}/sleep").status_code == 404
        assert httpx.get(f"{worker.base_url}/is_sleeping").status_code == 404
