"""Restore on lead time, the pure policy: what it does on a signal given the session's
residency, the worker's load and the tenant's budgets (table-driven), how it settles, and
how it switches itself off when leads are too short or prefetches go unused."""

from __future__ import annotations

import pytest

from appliance.policy.prefetch import (
    DEFAULT_PROBE_EVERY,
    PrefetchAction,
    PrefetchAsk,
    PrefetchKey,
    PrefetchKind,
    PrefetchNeed,
    PrefetchPolicy,
    PrefetchTrigger,
    PrefetchTuning,
    WorkerLoad,
)
from appliance.policy.return_due import first_likely_return_s
from appliance.policy.survival import WaitKey, WaitSurvival
from appliance.policy.wait_curves import LogNormal

GIB = 1 << 30
KEY = PrefetchKey("acme", "test", PrefetchTrigger.TOOL_FINISHED)
IDLE = WorkerLoad(waiting=0, running=1)


def need(tokens: int = 10_000, gpu: int = 2_000, host: int = 0, kv_bytes: int = GIB,
         prefill_s: float = 0.3) -> PrefetchNeed:  # fmt: skip
    return PrefetchNeed(tokens, gpu, host, kv_bytes, copy_s=0.02, prefill_s=prefill_s)


A, K = PrefetchAction, PrefetchKind
CASES = [
    # (what, need, worker, in flight, tuning, expected action, expected kind)
    ("host part: promote", need(host=8_000), IDLE, False, {}, A.PROMOTE, K.HOST_COPY),
    ("host part, requests wait", need(host=8_000), WorkerLoad(1, 8), False, {},
     A.SKIP, K.BUSY),
    ("host part, requests wait, as many as allowed", need(host=8_000), WorkerLoad(2, 8), False,
     {"max_waiting": 2}, A.PROMOTE, K.HOST_COPY),
    ("nothing cached past HBM, idle worker: prefill", need(), IDLE, False, {},
     A.PREFILL, K.IDLE_PREFILL),
    ("nothing cached past HBM, requests wait", need(), WorkerLoad(1, 1), False, {},
     A.SKIP, K.BUSY),
    ("nothing cached past HBM, prefill off", need(), IDLE, False, {"prefill": False},
     A.SKIP, K.NO_PREFILL),
    ("all in HBM", need(gpu=10_000), IDLE, False, {}, A.SKIP, K.RESIDENT),
    ("no prefix known", need(tokens=0, gpu=0), IDLE, False, {}, A.SKIP, K.NOTHING),
    ("one in flight", need(host=8_000), IDLE, True, {}, A.SKIP, K.IN_FLIGHT),
    ("over the tenant's bytes", need(host=8_000, kv_bytes=9 * GIB), IDLE, False, {},
     A.SKIP, K.BYTES_BUDGET),
    ("over the tenant's prefill bucket", need(prefill_s=11.0), IDLE, False, {},
     A.SKIP, K.PREFILL_BUDGET),
    ("a signal that is not used", need(host=8_000), IDLE, False,
     {"triggers": frozenset({PrefetchTrigger.HAZARD})}, A.SKIP, K.NOTHING),
    ("prefill before any lead is seen", need(), IDLE, False, {"lead": None},
     A.SKIP, K.LEAD_UNMEASURED),
    ("promote before any lead is seen", need(host=8_000), IDLE, False, {"lead": None},
     A.PROMOTE, K.HOST_COPY),
]  # fmt: skip


@pytest.mark.parametrize(
    ("need_", "worker", "in_flight", "tuning", "action", "kind"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_signal_is_answered_by_residency_load_and_budget(
    need_: PrefetchNeed,
    worker: WorkerLoad,
    in_flight: bool,
    tuning: dict[str, object],
    action: PrefetchAction,
    kind: PrefetchKind,
) -> None:
    settings = dict(tuning)
    lead = settings.pop("lead", 1.0)
    policy = PrefetchPolicy(PrefetchTuning(**settings))  # type: ignore[arg-type]
    if lead is not None:
        policy.observe_lead(KEY, lead)  # type: ignore[arg-type]
    d = policy.decide(PrefetchAsk(KEY, need_, worker, in_flight), now=0.0)
    assert (d.action, d.kind) == (action, kind)
    assert d.reason
    charged = GIB if action is not A.SKIP else 0
    assert policy.outstanding_bytes("acme") == charged


def test_speculative_bytes_are_charged_until_settled() -> None:
    policy = PrefetchPolicy(PrefetchTuning(budget_bytes=2 * GIB))
    ask = PrefetchAsk(KEY, need(host=8_000), IDLE)
    first = policy.decide(ask, 0.0)
    assert policy.decide(ask, 0.0).action is A.PROMOTE  # 2 GiB in all: at the budget
    assert policy.decide(ask, 0.0).kind is K.BYTES_BUDGET
    other = PrefetchKey("other", "test", PrefetchTrigger.TOOL_FINISHED)
    assert policy.decide(PrefetchAsk(other, need(host=8_000), IDLE), 0.0).action is A.PROMOTE
    policy.settle(first, used=True)
    assert policy.outstanding_bytes("acme") == GIB
    assert policy.decide(ask, 0.0).action is A.PROMOTE


def test_the_prefill_bucket_refills_at_its_rate() -> None:
    policy = PrefetchPolicy(PrefetchTuning(prefill_rate=0.5, prefill_burst_s=2.0))
    policy.observe_lead(KEY, 1.0)
    ask = PrefetchAsk(KEY, need(prefill_s=1.5), IDLE)
    assert policy.decide(ask, 0.0).action is A.PREFILL  # 0.5 s left
    assert policy.decide(ask, 1.0).kind is K.PREFILL_BUDGET  # 1.0 s
    assert policy.decide(ask, 2.0).action is A.PREFILL  # 1.5 s
    assert policy.decide(ask, 100.0).action is A.PREFILL  # capped at the burst


@pytest.mark.parametrize(
    ("leads", "kind"),
    [([0.0] * 5, K.LEAD_TOO_SHORT), ([0.01, 0.02, 0.03], K.LEAD_TOO_SHORT), ([0.2] * 3, None)],
)
def test_a_key_whose_signals_come_too_late_switches_itself_off(
    leads: list[float], kind: PrefetchKind | None
) -> None:
    policy = PrefetchPolicy(PrefetchTuning(triggers=frozenset(PrefetchTrigger)))
    for lead in leads:
        policy.observe_lead(KEY, lead)
    d = policy.decide(PrefetchAsk(KEY, need(host=8_000), IDLE), 0.0)
    assert (d.kind if d.action is A.SKIP else None) == kind
    other = PrefetchKey("acme", "test", PrefetchTrigger.HAZARD)  # measured apart
    assert policy.decide(PrefetchAsk(other, need(host=8_000), IDLE), 0.0).action is A.PROMOTE


def test_and_switches_back_on_when_leads_lengthen() -> None:
    policy = PrefetchPolicy()
    for _ in range(5):
        policy.observe_lead(KEY, 0.0)
    for _ in range(10):
        policy.observe_lead(KEY, 1.0)
    lead = policy.lead_s(KEY)
    assert lead is not None and lead > 0.5
    assert policy.decide(PrefetchAsk(KEY, need(host=8_000), IDLE), 0.0).action is A.PROMOTE


def test_a_key_whose_prefetches_go_unused_switches_off_but_probes() -> None:
    policy = PrefetchPolicy()
    ask = PrefetchAsk(KEY, need(host=8_000, kv_bytes=1), IDLE)
    for _ in range(5):
        policy.settle(policy.decide(ask, 0.0), used=False)
    assert policy.accuracy(KEY) == 0.0
    answers = [policy.decide(ask, 0.0) for _ in range(2 * DEFAULT_PROBE_EVERY)]
    probes = [d for d in answers if d.action is A.PROMOTE]
    assert len(probes) == 2
    assert all(d.kind is K.LOW_ACCURACY for d in answers if d.action is A.SKIP)
    for d in probes:
        policy.settle(d, used=True)


def test_a_key_used_often_enough_stays_on() -> None:
    policy = PrefetchPolicy()
    ask = PrefetchAsk(KEY, need(host=8_000, kv_bytes=1), IDLE)
    for used in [True, True, True, False] * 3:
        policy.settle(policy.decide(ask, 0.0), used=used)
    assert policy.accuracy(KEY) == pytest.approx(0.75, abs=0.05)
    assert policy.decide(ask, 0.0).action is A.PROMOTE


def test_only_announcements_are_used_unless_asked_for() -> None:
    policy = PrefetchPolicy()
    for trigger in PrefetchTrigger:
        d = policy.decide(PrefetchAsk(KEY._replace(trigger=trigger), need(host=8_000), IDLE), 0.0)
        assert (d.action is A.PROMOTE) == (trigger is PrefetchTrigger.TOOL_FINISHED)


def test_the_first_likely_return_follows_the_wait_model() -> None:
    model = WaitSurvival({"test": LogNormal(30.0, 0.05)})
    key = WaitKey("acme", "test")
    due = first_likely_return_s(model, key, hint_s=None, horizon_s=1800.0)
    assert due is not None and 20.0 < due < 30.0
    broad = WaitSurvival({"test": LogNormal.from_median_p95(30.0, 120.0)})
    assert first_likely_return_s(broad, key, hint_s=None, horizon_s=1800.0) is None
    assert first_likely_return_s(model, key, hint_s=None, horizon_s=10.0) is None


def test_a_restore_is_worth_its_accuracy_and_lead() -> None:
    policy = PrefetchPolicy()
    ask = PrefetchAsk(KEY, need(prefill_s=0.5, kv_bytes=GIB), IDLE)
    policy.observe_lead(KEY, 2.0)
    first = policy.decide(ask, 0.0)
    assert first.value == pytest.approx(1.0 * 0.5 / (GIB * 2.0))
    policy.settle(first, used=True)
    policy.settle(policy.decide(ask, 0.0), used=False)
    later = policy.decide(ask, 0.0)
    assert 0 < later.value < first.value  # half its restores are used now
    promote = policy.decide(PrefetchAsk(KEY, need(host=8_000, kv_bytes=GIB), IDLE), 0.0)
    assert promote.value == pytest.approx(0.02 * later.value / 0.5)  # saves its copy
