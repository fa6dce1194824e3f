"""The seed failure mode "stale cache directory", end to end: `appliance up` routes a turn on
a claim its KV index holds for blocks the worker has already evicted, because the worker's
KV events reach the index late.

The worker is a real simulated vLLM worker (`appliance sim`, one process, a pool of 128
blocks of 32 tokens) served to `appliance up --engine external`; its KV events go through a
relay in the test (a ZMQ SUB -> PUB forwarder) that can hold them back, as a congested
event socket or a slow subscriber would. Nothing of the worker or of the appliance is
replaced: the events the index applies are the worker's own, in its order, only later.

The story the test tells, with the figures it prints: a session's first turn leaves its
prefix cached and the index knows it; the relay then holds the events while other prompts,
three times the pool, evict that prefix; the session's next turn is placed on the stale
claim (its route decision and its turn row say the predicted cached tokens), answered
correctly by a full re-prefill (the worker's own cached tokens: none), and the ledger keeps
the predicted-vs-actual gap. The held events are then let through in order: the batches
from before that turn take the claim away (the index shows none of the old prefix), and
those after it bring back what the re-prefill stored, so a third turn is predicted what it
gets. Each receipt names the worker's cache generation (no reset here: the first).

The second test restarts the worker between two turns, the lag the product has of its own:
the index hears of the restart only from the new process's first events. The turn placed
before then is prefilled again as above; the restart then starts a new cache generation,
which the next receipts name, so the older ones read as stale.
"""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tests.ports import free_port
from tests.running import BIN, add_key, appliance_process, eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
BLOCK = 32
POOL_BLOCKS = 128
PROMPT = 1000  # 31 full blocks: 992 tokens a next turn can find cached
FLOOD_TIMES_POOL = 3


class EventRelay:
    """Forwards a worker's KV-event batches (SUB bound at `inbound`, PUB connected to
    `outbound`), in order; `hold` keeps the ones that arrive from then on until `release`."""

    def __init__(self, inbound: str, outbound: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(inbound)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.connect(outbound)
        self._lock = threading.Lock()
        self._waiting: list[list[bytes]] = []
        self._allowed: int | None = None  # None: everything passes
        self.received = 0
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(20):
                frames = self._sub.recv_multipart()
                with self._lock:
                    self._waiting.append(frames)
                    self.received += 1
            with self._lock:
                while self._waiting and (self._allowed is None or self._allowed > 0):
                    self._pub.send_multipart(self._waiting.pop(0))
                    self.sent += 1
                    if self._allowed is not None:
                        self._allowed -= 1
        self._sub.close(0)
        self._pub.close(0)

    def hold(self) -> None:
        with self._lock:
            self._allowed = 0

    def release(self, batches: int | None = None) -> None:
        """Lets `batches` more held batches through (None: all, and all from now on)."""
        with self._lock:
            self._allowed = None if batches is None else (self._allowed or 0) + batches

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.received, self.sent

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()


class Worker:
    """The simulated worker's process, started again on the same ports when asked."""

    def __init__(self, argv: list[str], log: Path, url: str) -> None:
        self.argv, self.log, self.url = argv, log, url
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            return subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def restart(self) -> None:
        """A restart: the new process has an empty cache and numbers its events from 0."""
        self.stop()
        self.proc = self._start()

        def up() -> bool:
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert eventually(up, bool, timeout_s=60), self.log.read_text()[-2000:]


@dataclass
class Stale:
    url: str
    key: str
    ops: str
    relay: EventRelay
    ledger: Path
    worker: Worker

    def completion(self, prompt: list[int], **headers: str) -> httpx.Response:
        body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
        auth = {"Authorization": f"Bearer {self.key}"}
        return httpx.post(
            f"{self.url}/v1/completions", json=body, headers=auth | headers, timeout=60
        )

    def serving(self) -> bool:
        r = httpx.get(
            f"{self.url}/admin/v1/state",
            headers={"Authorization": f"Bearer {self.ops}"},
            timeout=10,
        )
        return all(w["healthy"] for w in r.json()["workers"])

    def index_gpu_tokens(self, session: str) -> int:
        """The session's last prompt as the KV index holds it on the worker's GPU now."""
        r = httpx.get(
            f"{self.url}/admin/v1/sessions/{session}",
            params={"tenant": "alice"},
            headers={"Authorization": f"Bearer {self.ops}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        return sum(row["tokens"] for row in r.json()["residency"] if row["tier"] != "gone")

    def rows(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.ledger)) as db:
            return db.execute(sql, args).fetchall()


@pytest.fixture(scope="module")
def stale(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stale]:
    data_dir = tmp_path_factory.mktemp("stale-cache")
    key, ops = add_key(data_dir, "alice"), add_key(data_dir, "ops", "--admin")
    port, inbound, outbound = free_port(), free_port(), free_port()
    relay = EventRelay(f"tcp://127.0.0.1:{inbound}", f"tcp://127.0.0.1:{outbound}")
    argv = [
        str(BIN / "appliance"),
        "sim",
        "--port",
        str(port),
        "--block-size",
        str(BLOCK),
        "--num-gpu-blocks-override",
        str(POOL_BLOCKS + 1),
        "--max-model-len",
        "4096",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{inbound}",
    ]
    sim = Worker(argv, data_dir / "sim.log", f"http://127.0.0.1:{port}")
    env = {
        "APPLIANCE_ENGINE__EXTERNAL_URLS": json.dumps([f"http://127.0.0.1:{port}"]),
        "APPLIANCE_ENGINE__EXTERNAL_KV_EVENT_ENDPOINTS": json.dumps(
            [f"tcp://127.0.0.1:{outbound}"]
        ),
    }
    try:
        with appliance_process(data_dir, engine="external", workers=None, env=env) as up:
            app = Stale(up.url, key, ops, relay, data_dir / "ledger.db", sim)
            events_flow(app)
            yield app
    finally:
        sim.stop()
        relay.close()


def settled(relay: EventRelay) -> tuple[int, int]:
    """The relay's counts once no batch has come for half a second."""
    last = relay.counts()
    while True:
        time.sleep(0.5)
        now = relay.counts()
        if now == last:
            return now
        last = now


def events_flow(app: Stale) -> None:
    """Until a probe turn's KV events reach the index. The relay's PUB connected to the
    appliance's endpoint before the appliance bound it, so it reconnects on ZMQ's timer
    (100-200 ms): a batch sent before that finds no subscriber and is dropped, as PUB does."""
    for probe in range(5):
        session = f"probe-{probe}"
        assert (
            cached(app.completion(tokens(900 + probe, 2 * BLOCK), **{"X-Session-ID": session})) == 0
        )
        if eventually(partial(app.index_gpu_tokens, session), bool, timeout_s=3):
            return
    pytest.fail("no KV event of five probe turns reached the index")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30_000) for _ in range(n)]


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def session_turns(app: Stale, n: int, session: str = "agent") -> list[tuple[Any, ...]]:
    """The session's first `n` turn rows (once written): id, prompt, predicted, cached."""
    sql = (
        "SELECT turn_id, prompt_tokens, predicted_cached_tokens, cached_tokens FROM turns"
        " WHERE tenant = 'alice' AND session_id = ? ORDER BY started_at"
    )
    return eventually(lambda: app.rows(sql, session), lambda r: len(r) >= n)[:n]


def session_receipts(app: Stale, n: int, session: str) -> list[tuple[Any, ...]]:
    """(token count, generation) of the receipts the session's turns left, in turn order."""
    sql = (
        "SELECT r.token_count, r.generation FROM cache_receipts r JOIN turns t"
        " ON r.worker = t.worker AND r.created_at = t.finished_at"
        " WHERE t.session_id = ? ORDER BY t.started_at"
    )
    return eventually(lambda: app.rows(sql, session), lambda rows: len(rows) == n)


def test_stale_cache_directory_a_turn_placed_on_an_evicted_prefix_is_prefilled_again(
    stale: Stale,
) -> None:
    app = stale
    claim = (PROMPT // BLOCK) * BLOCK
    first = tokens(1, PROMPT)
    assert cached(app.completion(first, **{"X-Session-ID": "agent"})) == 0
    known = eventually(lambda: app.index_gpu_tokens("agent"), lambda n: n >= claim)
    assert known == claim  # the index heard the worker store the whole prefix

    app.relay.hold()  # the worker's KV events from here on reach the index late
    flood = FLOOD_TIMES_POOL * POOL_BLOCKS * BLOCK // PROMPT + 1
    for i in range(flood):  # other prompts, three times the pool: the prefix is evicted
        assert cached(app.completion(tokens(100 + i, PROMPT))) == 0
    received, sent = settled(app.relay)
    assert received > sent  # the flood's stores and evictions are held back
    assert app.index_gpu_tokens("agent") == claim  # so the index still claims the prefix

    second = first + tokens(2, 100)
    r = app.completion(second, **{"X-Session-ID": "agent"})
    assert cached(r) == 0, r.json()  # the worker prefilled the whole prompt again
    assert r.json()["choices"][0]["text"]  # and answered
    turn_id, prompt, predicted, actual = session_turns(app, 2)[1]
    print(
        f"turn placed on a stale claim: predicted {predicted} cached tokens of {prompt},"
        f" the worker had {actual}; {received - sent} KV-event batches held"
    )
    assert (prompt, predicted, actual) == (len(second), claim, 0)  # the gap, in the ledger
    (candidates,) = eventually(
        lambda: app.rows("SELECT candidates FROM route_decisions WHERE turn_id = ?", turn_id),
        bool,
    )[0]
    assert [(c["worker"], c["resident_tokens"]) for c in json.loads(candidates)] == [
        ("w0", claim)  # placed on the claim
    ]

    # The batches from before that turn arrive: the index drops its claim.
    app.relay.release(received - sent)
    eventually(app.relay.counts, lambda c: c[1] >= received)
    assert eventually(lambda: app.index_gpu_tokens("agent"), lambda n: n == 0) == 0
    # The rest (the re-prefill's stores): the index holds what the worker holds.
    app.relay.release()
    again = (len(second) // BLOCK) * BLOCK
    assert eventually(lambda: app.index_gpu_tokens("agent"), lambda n: n == again) == again
    third = second + tokens(3, 100)
    assert cached(app.completion(third, **{"X-Session-ID": "agent"})) == again
    _, _, predicted, actual = session_turns(app, 3)[2]
    assert predicted == actual == again  # no gap once the events are in

    assert session_receipts(app, 3, "agent") == [
        (claim, 0),
        (again, 0),
        ((len(third) // BLOCK) * BLOCK, 0),
    ]


def test_stale_cache_directory_a_restarted_worker_starts_a_new_generation(stale: Stale) -> None:
    """A worker restarted between two turns: its new process holds nothing, and the index
    learns so only from the new process's first KV events (their sequence starts again),
    the restarted worker's own lag. The turn placed before then is prefilled again like the
    one above; the reset then starts a new generation of the worker's cache, so the first
    turn's receipt is stale (older than the worker's newest) and the next turn's is not."""
    app = stale
    app.relay.release()
    claim = (PROMPT // BLOCK) * BLOCK
    first = tokens(7, PROMPT)
    assert cached(app.completion(first, **{"X-Session-ID": "restarted"})) == 0
    assert eventually(lambda: app.index_gpu_tokens("restarted"), lambda n: n >= claim) == claim

    app.worker.restart()
    assert eventually(app.serving, bool)
    assert app.index_gpu_tokens("restarted") == claim  # the old process's blocks, claimed
    second = first + tokens(8, 100)
    assert cached(app.completion(second, **{"X-Session-ID": "restarted"})) == 0
    _, prompt, predicted, actual = session_turns(app, 2, "restarted")[1]
    print(
        f"turn placed on a restarted worker: predicted {predicted} cached tokens of"
        f" {prompt}, the worker had {actual}"
    )
    assert (predicted, actual) == (claim, 0)

    again = (len(second) // BLOCK) * BLOCK
    assert eventually(lambda: app.index_gpu_tokens("restarted"), lambda n: n == again) == again
    third = second + tokens(9, 100)
    assert cached(app.completion(third, **{"X-Session-ID": "restarted"})) == again
    assert session_turns(app, 3, "restarted")[2][2:] == (again, again)
    receipts = session_receipts(app, 3, "restarted")
    (_, before), (_, during), (_, after) = receipts
    # Placed before the index knew of the restart, the second turn's receipt names the
    # old generation too (stale, though its prefix is cached: the safe side).
    assert before == during == after - 1, receipts
