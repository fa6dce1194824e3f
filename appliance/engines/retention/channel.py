"""The connector's end of the control channel, on a daemon thread of its own.

A DEALER socket, its identity the connector's incarnation, connects to the ROUTER the
appliance bound for this worker (the appliance owns the port, as with KV events; ZMQ
reconnects by itself). The first thing it sends is its first report, seq 0, holding
nothing: the appliance's hello from a new (or restarted) worker. Directives are decoded
here and only queued: the scheduler thread applies them (vLLM's block pool has no lock),
and hands reports back through `publish`; this thread numbers and sends them, answers a
query with the latest, and sends the latest again when `report_interval_s` passed without
one. A message that does not decode is logged and dropped: the channel never raises into
vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress

import msgspec
import zmq

from appliance.engines.retention.protocol import (
    RetentionDirective,
    RetentionQuery,
    RetentionReport,
    decode_directive,
    encode_retention,
)

log = logging.getLogger("vllm.appliance.retention")  # under vLLM's logger: its config shows it


class ControlChannel:
    def __init__(
        self,
        endpoint: str,
        first: RetentionReport,
        *,
        report_interval_s: float = 5.0,
        poll_s: float = 0.05,
        on_directive: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._on_directive = on_directive
        """Called on this thread as a directive comes (a simulated worker's engine loop
        wakes for it; vLLM's scheduler takes them at its next step)."""
        self.directives: queue.SimpleQueue[RetentionDirective] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[RetentionReport] = queue.SimpleQueue()
        self._latest = first
        self._interval_s = report_interval_s
        self._poll_ms = int(poll_s * 1000)
        self._seq = 0
        self._last_sent = 0.0
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="retention-control", daemon=True)

    def pending(self) -> Iterator[RetentionDirective]:
        """The directives received and not yet taken, oldest first."""
        while not self.directives.empty():
            yield self.directives.get_nowait()

    def start(self) -> ControlChannel:
        self._thread.start()
        return self

    def publish(self, report: RetentionReport) -> None:
        """From the scheduler thread: the state now, sent as soon as this thread wakes."""
        self._latest = report
        self._outbox.put(report)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        if not self._thread.is_alive():
            self._ctx.term()

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._latest.incarnation.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        log.info("retention control channel to %s", self.endpoint)
        try:
            self._send(sock, self._latest)
            while not self._stop.is_set():
                if sock.poll(self._poll_ms):
                    self._receive(sock)
                while not self._outbox.empty():
                    self._send(sock, self._outbox.get_nowait())
                if time.monotonic() - self._last_sent >= self._interval_s:
                    self._send(sock, msgspec.structs.replace(self._latest, given_back=()))
            while not self._outbox.empty():  # closing: what was published last still goes
                self._send(sock, self._outbox.get_nowait())
        except Exception:  # never into vLLM; the appliance sees the reports stop
            log.exception("retention control channel stopped")
        finally:
            sock.close(linger=200)  # a moment for the last report, no more

    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        data = sock.recv()
        try:
            directive = decode_directive(data)
        except ValueError as exc:
            log.warning("retention: undecodable directive dropped (%s)", exc)
            return
        if isinstance(directive, RetentionQuery):
            self._send(sock, msgspec.structs.replace(self._latest, given_back=()))
        else:
            self.directives.put(directive)
            if self._on_directive is not None:
                self._on_directive()

    def _send(self, sock: zmq.Socket[bytes], report: RetentionReport) -> None:
        report = msgspec.structs.replace(report, seq=self._seq)
        self._seq += 1
        self._last_sent = time.monotonic()
        with suppress(zmq.Again):  # the appliance is not reading: the next report says it
            sock.send(encode_retention(report), zmq.NOBLOCK)
