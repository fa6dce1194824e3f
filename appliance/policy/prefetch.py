"""Restore on lead time: whether to bring a waiting session's KV back into a worker's HBM
before its next turn arrives, and how.

Model of the world: a session waits on a tool while its KV sits where the residency policy
left it: held in HBM, demoted to the worker's host tier, or released (then, unless
another request shares it, nothing is cached anywhere). Its next turn re-sends the
conversation, whose stable prefix (the session's last prompt, in whole blocks) is known
now. Three signals say the turn is near (`PrefetchTrigger`): the client announces the
tool's end (`tool_finished`); the survival model of waits, with the client's expected
duration as far as its record earns trust (`tool_started`'s `expected_s`), says the turn
is likely within a window (`TOOL_DUE`); or the same model from history alone says so
(`HAZARD`); only the first is on by default (`DEFAULT_TRIGGERS`). On a signal the caller
asks `decide` with the worker the router would place the turn on, how much of the prefix
that worker holds in HBM and, past that, in its host tier, and its load. The answer:
PROMOTE (copy the host part to HBM: the turn's TTFT then holds only the part of the copy
not done yet), PREFILL (nothing of it is cached anywhere past the HBM hit: compute it
while the worker is idle) or SKIP, each with a kind (`PrefetchKind`) and a sentence.

Bounds: per tenant, the bytes of speculative KV not yet settled (`budget_bytes`) and a
bucket of prefill seconds that refills at `prefill_rate` up to `prefill_burst_s`; paused
under load (more than `max_waiting` requests waiting for admission on the worker). A
decision carries its `value`, the reaper's value density (`appliance.policy.reaper`) of the
restored KV: P(used) x seconds saved / (bytes x seconds until the turn), from the key's
measured accuracy and lead: where the restored KV ranks among the worker's holds until its
turn comes (a hold ranked by the session's wait alone would be the first to go). Every
prefetch is settled once by the caller (`settle`: was it used by the next turn?) and every
signal's lead (the seconds from the signal to the turn) is reported (`observe_lead`), per
key (tenant, tool class, trigger).

Switching itself off: a key whose measured lead (decayed mean) is under `min_lead_s`
cannot finish anything before its turn (LEAD_TOO_SHORT); one whose measured accuracy
(decayed share of prefetches used) is under `min_accuracy` after `min_samples` wastes
more than the floor allows (LOW_ACCURACY). Leads are measured on every signal, issued or
not, so the first rule lifts as soon as leads lengthen; the second lets every
`probe_every`-th ask through to keep measuring. A prefill, which takes the GPU, also waits
for the key's first lead (LEAD_UNMEASURED): a signal that comes with its turn would start
one just as the turn arrives (a promotion is the copy the turn would make anyway).

Pure: no clock (times are arguments), no I/O, no randomness.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from appliance.policy.reaper import value_density

DEFAULT_BUDGET_BYTES = 8 << 30
"""Judgement: a tenant's unsettled speculative KV, two full 30k-token contexts of the bundled
Llama-3-8B (3.9 GB each); a prefetch is settled within seconds (its turn, or its hold)."""
DEFAULT_PREFILL_RATE = 0.25
"""Judgement: a tenant may spend a quarter of one GPU's time on speculative prefill."""
DEFAULT_PREFILL_BURST_S = 10.0
"""Judgement: ten seconds of prefill at once (a dozen 30k-token contexts)."""
DEFAULT_MAX_WAITING = 0
"""Judgement: a worker where any request waits for admission is under load: a prefetch would
take the blocks, budget or copy channel that request needs next."""
DEFAULT_MIN_LEAD_S = 0.05
"""Judgement: under 50 ms of lead (a step of 2k prefill tokens, or 0.4 GB of copy on the
bundled profile) a prefetch finishes nothing before its turn: the turn does the work."""
DEFAULT_MIN_ACCURACY = 0.7
"""Judgement: a key whose prefetches go unused more than three times in ten costs more
bytes and idle prefill than its hits save (and the issue's bound is a fifth of the bytes)."""
DEFAULT_MIN_SAMPLES = 5
DEFAULT_PROBE_EVERY = 16
"""A switched-off key still prefetches on every 16th ask, so its accuracy is measured."""
DEFAULT_HALF_LIFE = 50.0
"""Judgement: leads and accuracy follow a change within about a hundred signals of a key."""
DEFAULT_HOLD_S = 30.0
"""Judgement: a prefetch the turn has not used within 30 s is given up (its KV is ordinary
cache from then on)."""
MIN_TOKENS = 1
MAX_KEYS = 4096


class PrefetchTrigger(StrEnum):
    TOOL_FINISHED = "tool_finished"
    """The client announced the tool's end."""
    TOOL_DUE = "tool_due"
    """The wait model with the client's expected duration says the turn is near."""
    HAZARD = "hazard"
    """The wait model from history alone says the turn is near."""


DEFAULT_TRIGGERS = frozenset({PrefetchTrigger.TOOL_FINISHED})
"""The client's announcements only: in the replay (docs/benchmarks.md) the wait model's
triggers added prefetches used less often (a fifth to a third of their bytes unused, where
announcements left a twentieth), so they are asked for by name."""


RESTORE_AHEAD_TRIGGERS = frozenset(PrefetchTrigger)
"""Restore ahead of the predicted return: the announcements and the wait model's times,
each key switched off by its own record (live with `residency.restore_ahead`, and the
agent-session replay's `appliance-restore`; docs/benchmarks.md, "Restore ahead of the
predicted return")."""


class PrefetchAction(StrEnum):
    PROMOTE = "promote"
    PREFILL = "prefill"
    SKIP = "skip"


class PrefetchKind(StrEnum):
    HOST_COPY = "host_copy"
    IDLE_PREFILL = "idle_prefill"
    RESIDENT = "resident"
    """The prefix is in the worker's HBM already."""
    IN_FLIGHT = "in_flight"
    """A prefetch of this idle period runs, or ran."""
    NOTHING = "nothing"
    """No stable prefix is known, or it is under a block."""
    BUSY = "busy"
    """Paused under load."""
    NO_PREFILL = "no_prefill"
    """Nothing is cached past the HBM hit and prefill is off."""
    BYTES_BUDGET = "bytes_budget"
    PREFILL_BUDGET = "prefill_budget"
    LEAD_TOO_SHORT = "lead_too_short"
    LEAD_UNMEASURED = "lead_unmeasured"
    """A prefill waits until the key's signals have shown how early they come."""
    LOW_ACCURACY = "low_accuracy"


class PrefetchKey(NamedTuple):
    tenant: str
    tool_class: str | None
    trigger: PrefetchTrigger


@dataclass(frozen=True, slots=True)
class PrefetchNeed:
    """What restoring the session's stable prefix on one worker would take."""

    tokens: int
    """The stable prefix, in whole blocks."""
    gpu_tokens: int
    """Of those, resident in the worker's HBM (leading)."""
    host_tokens: int
    """Past those, held by the worker's host tier (leading)."""
    kv_bytes: int
    """Bytes of the part to restore (host part, else the missing part)."""
    copy_s: float = 0.0
    """Seconds to copy the host part to HBM."""
    prefill_s: float = 0.0
    """Seconds to prefill the missing part (past the HBM hit)."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    waiting: int
    """Requests queued for admission (or for their KV's copy from the host tier)."""
    running: int


@dataclass(frozen=True, slots=True)
class PrefetchAsk:
    key: PrefetchKey
    need: PrefetchNeed
    worker: WorkerLoad
    in_flight: bool = False
    """A prefetch of this idle period runs or was done."""


@dataclass(frozen=True, slots=True)
class PrefetchDecision:
    action: PrefetchAction
    kind: PrefetchKind
    reason: str
    key: PrefetchKey
    kv_bytes: int = 0
    """Charged to the tenant's budget until `settle`."""
    prefill_s: float = 0.0
    """Drawn from the tenant's prefill bucket."""
    value: float = 0.0
    """Value density of the restored KV (seconds saved per byte-second): its rank among the
    worker's holds until its turn."""


@dataclass(frozen=True, slots=True)
class PrefetchTuning:
    """The policy's settings (see each default's note)."""

    budget_bytes: int = DEFAULT_BUDGET_BYTES
    prefill_rate: float = DEFAULT_PREFILL_RATE
    prefill_burst_s: float = DEFAULT_PREFILL_BURST_S
    max_waiting: int = DEFAULT_MAX_WAITING
    min_lead_s: float = DEFAULT_MIN_LEAD_S
    min_accuracy: float = DEFAULT_MIN_ACCURACY
    prefill: bool = True
    triggers: frozenset[PrefetchTrigger] = DEFAULT_TRIGGERS

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or self.prefill_rate < 0 or self.prefill_burst_s < 0:
            raise ValueError("prefetch budgets must be >= 0")
        if self.max_waiting < 0 or not 0 <= self.min_accuracy <= 1:
            raise ValueError("max_waiting must be >= 0, min_accuracy in [0, 1]")
        if not (self.min_lead_s >= 0 and math.isfinite(self.min_lead_s)):
            raise ValueError(f"min_lead_s must be finite and >= 0, got {self.min_lead_s!r}")


class _KeyRecord:
    """A key's decayed lead and accuracy, and its probe count."""

    __slots__ = ("lead_s", "lead_weight", "probes", "settled", "used", "weight")

    def __init__(self) -> None:
        self.lead_s = self.lead_weight = self.used = self.weight = 0.0
        self.probes = self.settled = 0


_DECAY = 0.5 ** (1 / DEFAULT_HALF_LIFE)


class PrefetchPolicy:
    """Restore on lead time; see the module."""

    def __init__(self, tuning: PrefetchTuning | None = None) -> None:
        self.tuning = tuning if tuning is not None else PrefetchTuning()
        self._records: OrderedDict[PrefetchKey, _KeyRecord] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._bucket: dict[str, tuple[float, float]] = {}  # tenant -> (seconds, at)

    def decide(self, ask: PrefetchAsk, now: float) -> PrefetchDecision:
        """What to do on a signal (`gate`, then `choose`)."""
        off = self.gate(ask.key)
        return off if off is not None else self.choose(ask, now)

    def choose(self, ask: PrefetchAsk, now: float) -> PrefetchDecision:
        """What to do on a signal that passed the `gate`; a PROMOTE or PREFILL is charged
        to the tenant's budgets until the caller settles it."""
        decision = self._choose(ask, now)
        if decision.action is not PrefetchAction.SKIP:
            tenant = ask.key.tenant
            self._bytes[tenant] = self._bytes.get(tenant, 0) + decision.kv_bytes
            level, _ = self._refill(tenant, now)
            self._bucket[tenant] = (level - decision.prefill_s, now)
        return decision

    def settle(self, decision: PrefetchDecision, *, used: bool) -> None:
        """A prefetch's end: its next turn used it or not (never came, went elsewhere, or
        the KV was gone first). Its bytes leave the tenant's budget; its key learns."""
        tenant = decision.key.tenant
        self._bytes[tenant] = max(0, self._bytes.get(tenant, 0) - decision.kv_bytes)
        r = self._record(decision.key)
        r.weight = r.weight * _DECAY + 1
        r.used = r.used * _DECAY + (1.0 if used else 0.0)
        r.settled += 1

    def refund(self, decision: PrefetchDecision, now: float) -> None:
        """A prefetch decided but never started (no room for it after all): its charges go
        back to the tenant's budgets, and its key learns nothing."""
        t, tenant = self.tuning, decision.key.tenant
        self._bytes[tenant] = max(0, self._bytes.get(tenant, 0) - decision.kv_bytes)
        level, _ = self._refill(tenant, now)
        self._bucket[tenant] = (min(t.prefill_burst_s, level + decision.prefill_s), now)

    def observe_lead(self, key: PrefetchKey, lead_s: float) -> None:
        """A signal of `key` came `lead_s` before its turn (issued or not)."""
        r = self._record(key)
        r.lead_weight = r.lead_weight * _DECAY + 1
        r.lead_s += (max(0.0, lead_s) - r.lead_s) / r.lead_weight

    def accuracy(self, key: PrefetchKey) -> float | None:
        """The key's decayed share of prefetches used (None: none settled yet)."""
        r = self._records.get(key)
        return None if r is None or not r.weight else r.used / r.weight

    def lead_s(self, key: PrefetchKey) -> float | None:
        """The key's decayed mean lead (None: no signal of it seen yet)."""
        r = self._records.get(key)
        return None if r is None or not r.lead_weight else r.lead_s

    def outstanding_bytes(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def gate(self, key: PrefetchKey) -> PrefetchDecision | None:
        """A SKIP when the key's signals are not used or it switched itself off (each call
        counts towards its next probe), else None: ask `choose` (before the caller looks
        at residency or load: most signals end here or there)."""
        t = self.tuning
        if key.trigger not in t.triggers:
            return _skip(key, PrefetchKind.NOTHING, f"the {key.trigger} signal is not used")
        r = self._records.get(key)
        if r is None:
            return None
        if r.lead_weight and r.lead_s < t.min_lead_s:
            return _skip(
                key,
                PrefetchKind.LEAD_TOO_SHORT,
                f"its signals come {r.lead_s * 1e3:.0f} ms before the turn, under "
                f"{t.min_lead_s * 1e3:.0f} ms",
            )
        if r.settled >= DEFAULT_MIN_SAMPLES and r.used / r.weight < t.min_accuracy:
            r.probes += 1  # pragma: no mutate (equivalent: counting down also probes every 16th)
            if r.probes % DEFAULT_PROBE_EVERY:
                return _skip(
                    key,
                    PrefetchKind.LOW_ACCURACY,
                    f"{r.used / r.weight:.0%} of its prefetches were used, under "
                    f"{t.min_accuracy:.0%}",
                )
        return None

    def _choose(self, ask: PrefetchAsk, now: float) -> PrefetchDecision:
        key, need, t = ask.key, ask.need, self.tuning
        if ask.in_flight:
            return _skip(key, PrefetchKind.IN_FLIGHT, "one is running or done for this wait")
        if need.tokens < MIN_TOKENS:
            return _skip(key, PrefetchKind.NOTHING, "no stable prefix to restore")
        if need.gpu_tokens >= need.tokens:
            return _skip(key, PrefetchKind.RESIDENT, "the prefix is in HBM already")
        if self._bytes.get(key.tenant, 0) + need.kv_bytes > t.budget_bytes:
            return _skip(
                key,
                PrefetchKind.BYTES_BUDGET,
                f"{need.kv_bytes / 2**20:.0f} MiB would pass the tenant's "
                f"{t.budget_bytes / 2**30:g} GiB of speculative KV",
            )
        if ask.worker.waiting > t.max_waiting:
            return _skip(key, PrefetchKind.BUSY, f"{ask.worker.waiting} requests wait there")
        if need.host_tokens > 0:
            return PrefetchDecision(
                PrefetchAction.PROMOTE,
                PrefetchKind.HOST_COPY,
                f"copy {need.host_tokens} tokens from the host tier ({need.copy_s * 1e3:.0f} ms)",
                key,
                kv_bytes=need.kv_bytes,
                value=self._value(key, need.copy_s, need.kv_bytes),
            )
        if not t.prefill:
            return _skip(key, PrefetchKind.NO_PREFILL, "nothing cached past HBM; prefill is off")
        if self.lead_s(key) is None:
            return _skip(key, PrefetchKind.LEAD_UNMEASURED, "no lead of its signals seen yet")
        level, _ = self._refill(key.tenant, now)
        if need.prefill_s > level:
            return _skip(
                key,
                PrefetchKind.PREFILL_BUDGET,
                f"{need.prefill_s:.2f} s of prefill, {level:.2f} s left in the tenant's bucket",
            )
        missing = need.tokens - need.gpu_tokens
        return PrefetchDecision(
            PrefetchAction.PREFILL,
            PrefetchKind.IDLE_PREFILL,
            f"prefill {missing} tokens while the worker is idle ({need.prefill_s:.2f} s)",
            key,
            kv_bytes=need.kv_bytes,
            prefill_s=need.prefill_s,
            value=self._value(key, need.prefill_s, need.kv_bytes),
        )

    def _value(self, key: PrefetchKey, saved_s: float, kv_bytes: int) -> float:
        """Value density of a restore: P(used) from the key's accuracy (1 before any is
        settled), the wait from its lead (a hold's length before any is seen)."""
        accuracy, lead_s = self.accuracy(key), self.lead_s(key)
        p = 1.0 if accuracy is None else accuracy
        return value_density(p, DEFAULT_HOLD_S if lead_s is None else lead_s, saved_s, kv_bytes)

    def _refill(self, tenant: str, now: float) -> tuple[float, float]:
        t = self.tuning
        level, at = self._bucket.get(tenant, (t.prefill_burst_s, now))
        return min(t.prefill_burst_s, level + max(0.0, now - at) * t.prefill_rate), now

    def _record(self, key: PrefetchKey) -> _KeyRecord:
        r = self._records.get(key)
        if r is None:
            r = self._records[key] = _KeyRecord()
            if len(self._records) > MAX_KEYS:
                self._records.popitem(last=False)  # pragma: no mutate (equivalent: None is false)
        else:
            self._records.move_to_end(key)
        return r


def _skip(key: PrefetchKey, kind: PrefetchKind, reason: str) -> PrefetchDecision:
    return PrefetchDecision(PrefetchAction.SKIP, kind, f"skip: {reason}", key)
