"""The virtual driver's fast path into a simulated engine, mixed into `SimEngine`
(`engine.py`): when the next step is a plain decode step, run it (`decode_step`) or a run of
them that touches no block (`decode_stretch`, `run_stretch`) without scheduling, the
outputs held for `take_decoded` (`decode_run.py` does the work).
"""

from __future__ import annotations

from appliance.sim.core.decode_run import DecodeRun
from appliance.sim.core.waiting_queue import RequestState, WaitingQueue
from appliance.sim.engine_io import RequestOutput, StepResult
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.prefetch_lane import PrefetchLane
from appliance.sim.kv.prefix_cache import PrefixCache
from appliance.sim.kv.residency_hook import ResidencyHook, RetentionHook


class EngineFastPath:
    """The plain-decode half of `SimEngine`: when a step needs no scheduling, and running it."""

    max_num_batched_tokens: int
    cache: PrefixCache
    host: HostTier | None
    prefetches: PrefetchLane
    _residency: ResidencyHook | None
    _retention: RetentionHook | None
    _running: list[RequestState]
    _waiting: WaitingQueue
    _loading: list[RequestState]
    _pending: list[RequestOutput]
    _decode: DecodeRun
    _now: float

    def decode_step(self, now: float) -> float | None:
        """The virtual driver's fast path (`decode_run.py`): if the next step is a plain
        decode step, run it now as `step` would, hold its outputs back for `take_decoded`
        and return its duration; else None, nothing done (call `step`)."""
        run = self._plain_run(now)
        duration = None if run is None else run.advance()
        if duration is not None:
            self._clock_to(now)
        return duration

    def decode_stretch(self, now: float) -> list[float]:
        """The durations of the plain decode steps from `now` on that touch no block and
        start before any pin falls due, `decode_step` after `decode_step`; nothing is run
        (`run_stretch` runs the first of them)."""
        run = self._plain_run(now)
        return [] if run is None else run.quiet_durations(now, self._pin_due())

    def run_stretch(self, durations: list[float], last_start: float) -> None:
        """Run the first `len(durations)` steps of `decode_stretch`, the last at `last_start`."""
        self._decode.run_quiet(durations)
        self._clock_to(last_start)

    def _plain_run(self, now: float) -> DecodeRun | None:
        """The decode run if the next step is a plain decode step, planned; else None."""
        if self._retention is not None or self._pending or self._waiting or self._loading:
            return None
        if self.prefetches.busy:
            return None  # (its `schedule` would take what the step leaves)
        due = self._pin_due()
        if due is not None and due <= now:
            return None
        run = self._decode
        if run.left <= 0 and not run.plan(self._running, self.max_num_batched_tokens):
            return None
        return run

    def _pin_due(self) -> float | None:
        """When the next pin falls due, where a step would look (None: never)."""
        if self._residency is not None or self.prefetches.started:
            return self.cache.next_pin_expiry_s()
        return None

    def _clock_to(self, now: float) -> None:
        self._now = now
        if self.host is not None:
            self.host.now_s = now

    def take_decoded(self, steps: int) -> StepResult:
        """The outputs of the `steps` oldest steps `decode_step` ran, as one step's."""
        return self._decode.take(steps)
