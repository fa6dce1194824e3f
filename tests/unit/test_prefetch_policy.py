"""Restore on lead time, the pure policy: what it does on a signal given the session's
residency, the worker's load and the tenant's budgets (table-driven), how it settles, and
how it switches itself off when leads are too short or prefetches go unused."""

from __future__ import annotations

import math

import pytest

from appliance.policy.prefetch import (
    DEFAULT_MIN_LEAD_S,
    DEFAULT_PROBE_EVERY,
    MAX_KEYS,
    RESTORE_AHEAD_TRIGGERS,
    PrefetchAction,
    PrefetchAsk,
    PrefetchDecision,
    PrefetchKey,
    PrefetchKind,
    PrefetchNeed,
    PrefetchPolicy,
    PrefetchTrigger,
    PrefetchTuning,
    WorkerLoad,
)
from appliance.policy.residency import IdleSession
from appliance.policy.return_due import (
    DEFAULT_DUE_THRESHOLD,
    DEFAULT_DUE_WINDOW_S,
    ONCE,
    RESTORE_AHEAD,
    RESTORE_RECHECK_S,
    DueRule,
    first_likely_return_s,
    signal_due_s,
)
from appliance.policy.survival import Outlook, WaitKey, WaitSurvival
from appliance.policy.wait_curves import EDGES, LogNormal
from tests.cases import case

GIB = 1 << 30
KEY = PrefetchKey("acme", "test", PrefetchTrigger.TOOL_FINISHED)
IDLE = WorkerLoad(waiting=0, running=1)


def need(
    tokens: int = 10_000,
    gpu: int = 2_000,
    host: int = 0,
    kv_bytes: int = GIB,
    prefill_s: float = 0.3,
) -> PrefetchNeed:
    return PrefetchNeed(tokens, gpu, host, kv_bytes, copy_s=0.02, prefill_s=prefill_s)


A, K = PrefetchAction, PrefetchKind
CASES = [
    # (what, need, worker, in flight, tuning, expected action, expected kind)
    case(("host part: promote", need(host=8_000), IDLE, False, {}), (A.PROMOTE, K.HOST_COPY)),
    case(
        ("host part, requests wait", need(host=8_000), WorkerLoad(1, 8), False, {}),
        (A.SKIP, K.BUSY),
    ),
    case(
        (
            "host part, requests wait, as many as allowed",
            need(host=8_000),
            WorkerLoad(2, 8),
            False,
            {"max_waiting": 2},
        ),
        (A.PROMOTE, K.HOST_COPY),
    ),
    case(
        ("nothing cached past HBM, idle worker: prefill", need(), IDLE, False, {}),
        (A.PREFILL, K.IDLE_PREFILL),
    ),
    case(
        ("nothing cached past HBM, requests wait", need(), WorkerLoad(1, 1), False, {}),
        (A.SKIP, K.BUSY),
    ),
    case(
        ("nothing cached past HBM, prefill off", need(), IDLE, False, {"prefill": False}),
        (A.SKIP, K.NO_PREFILL),
    ),
    case(("all in HBM", need(gpu=10_000), IDLE, False, {}), (A.SKIP, K.RESIDENT)),
    case(("no prefix known", need(tokens=0, gpu=0), IDLE, False, {}), (A.SKIP, K.NOTHING)),
    case(("one in flight", need(host=8_000), IDLE, True, {}), (A.SKIP, K.IN_FLIGHT)),
    case(
        ("over the tenant's bytes", need(host=8_000, kv_bytes=9 * GIB), IDLE, False, {}),
        (A.SKIP, K.BYTES_BUDGET),
    ),
    case(
        ("over the tenant's prefill bucket", need(prefill_s=11.0), IDLE, False, {}),
        (A.SKIP, K.PREFILL_BUDGET),
    ),
    case(
        (
            "a signal that is not used",
            need(host=8_000),
            IDLE,
            False,
            {"triggers": frozenset({PrefetchTrigger.HAZARD})},
        ),
        (A.SKIP, K.NOTHING),
    ),
    case(
        ("prefill before any lead is seen", need(), IDLE, False, {"lead": None}),
        (A.SKIP, K.LEAD_UNMEASURED),
    ),
    case(
        ("promote before any lead is seen", need(host=8_000), IDLE, False, {"lead": None}),
        (A.PROMOTE, K.HOST_COPY),
    ),
]


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


def test_a_prefetch_that_never_started_is_refunded_and_teaches_nothing() -> None:
    policy = PrefetchPolicy(PrefetchTuning(prefill_burst_s=1.0))
    policy.observe_lead(KEY, 1.0)
    ask = PrefetchAsk(KEY, need(prefill_s=0.8), IDLE)
    decision = policy.decide(ask, 0.0)
    assert decision.action is A.PREFILL and policy.decide(ask, 0.0).kind is K.PREFILL_BUDGET
    policy.refund(decision, 0.0)
    assert policy.outstanding_bytes("acme") == 0 and policy.accuracy(KEY) is None
    assert policy.decide(ask, 0.0).action is A.PREFILL  # the bucket has its 0.8 s back


def test_a_refund_gives_back_that_prefetch_and_no_more() -> None:
    policy = PrefetchPolicy(PrefetchTuning(prefill_burst_s=2.0, prefill_rate=0.0))
    policy.observe_lead(KEY, 1.0)
    ask = PrefetchAsk(KEY, need(prefill_s=0.8, kv_bytes=GIB), IDLE)
    first, _ = policy.decide(ask, 0.0), policy.decide(ask, 0.0)
    policy.refund(first, 0.0)
    assert policy.outstanding_bytes("acme") == GIB  # the other one's
    assert [policy.decide(ask, 0.0).action for _ in range(2)] == [A.PREFILL, A.SKIP]


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


# --- each decision's exact sentence and key (the ledger's and the console's words) ---

REASONS = [
    case(
        (need(host=8_000, kv_bytes=GIB, prefill_s=0.3), {}, IDLE, False),
        ("copy 8000 tokens from the host tier (20 ms)",),
    ),
    case(
        (PrefetchNeed(10_000, 2_000, 8_000, GIB, copy_s=2.0), {}, IDLE, False),
        ("copy 8000 tokens from the host tier (2000 ms)",),
    ),
    case((need(), {}, IDLE, False), ("prefill 8000 tokens while the worker is idle (0.30 s)",)),
    case((need(), {}, WorkerLoad(3, 1), False), ("skip: 3 requests wait there",)),
    case((need(), {}, IDLE, True), ("skip: one is running or done for this wait",)),
    case((need(tokens=0, gpu=0), {}, IDLE, False), ("skip: no stable prefix to restore",)),
    case((need(gpu=10_000), {}, IDLE, False), ("skip: the prefix is in HBM already",)),
    case(
        (need(kv_bytes=3 * GIB), {"budget_bytes": GIB}, IDLE, False),
        ("skip: 3072 MiB would pass the tenant's 1 GiB of speculative KV",),
    ),
    case(
        (need(), {"prefill": False}, IDLE, False),
        ("skip: nothing cached past HBM; prefill is off",),
    ),
    case(
        (need(prefill_s=11.0), {}, IDLE, False),
        ("skip: 11.00 s of prefill, 10.00 s left in the tenant's bucket",),
    ),
]


@pytest.mark.parametrize(("need_", "tuning", "worker", "in_flight", "reason"), REASONS)
def test_each_decision_states_its_exact_reason(
    need_: PrefetchNeed,
    tuning: dict[str, object],
    worker: WorkerLoad,
    in_flight: bool,
    reason: str,
) -> None:
    policy = PrefetchPolicy(PrefetchTuning(**tuning))  # type: ignore[arg-type]
    policy.observe_lead(KEY, 1.0)
    d = policy.decide(PrefetchAsk(KEY, need_, worker, in_flight), 0.0)
    assert (d.reason, d.key) == (reason, KEY)


def test_the_gates_state_their_exact_reasons() -> None:
    hazard = KEY._replace(trigger=PrefetchTrigger.HAZARD)
    policy = PrefetchPolicy(PrefetchTuning(min_lead_s=2.0))
    off = policy.decide(PrefetchAsk(hazard, need(), IDLE), 0.0)
    assert (off.reason, off.key) == ("skip: the hazard signal is not used", hazard)
    unmeasured = policy.decide(PrefetchAsk(KEY, need(), IDLE), 0.0)
    assert (unmeasured.reason, unmeasured.key) == ("skip: no lead of its signals seen yet", KEY)
    policy.observe_lead(KEY, 1.0)
    late = policy.decide(PrefetchAsk(KEY, need(), IDLE), 0.0)
    assert late.reason == "skip: its signals come 1000 ms before the turn, under 2000 ms"
    assert late.key == KEY
    unused = PrefetchPolicy()
    unused.observe_lead(KEY, 1.0)
    ask = PrefetchAsk(KEY, need(host=8_000, kv_bytes=1), IDLE)
    for used in (True, True, True, False, False):
        unused.settle(unused.decide(ask, 0.0), used=used)
    low = unused.decide(ask, 0.0)
    assert (low.reason, low.key) == ("skip: 59% of its prefetches were used, under 70%", KEY)


# --- boundaries ---


@pytest.mark.parametrize(
    ("need_", "action"),
    [
        (need(tokens=1, gpu=0), A.PREFILL),  # one token is something to restore
        (need(host=1), A.PROMOTE),  # one host token is a promotion
    ],
)
def test_the_smallest_restores_are_restores(need_: PrefetchNeed, action: PrefetchAction) -> None:
    policy = PrefetchPolicy()
    policy.observe_lead(KEY, 1.0)
    assert policy.decide(PrefetchAsk(KEY, need_, IDLE), 0.0).action is action


def test_a_restore_that_fills_the_budget_exactly_goes_ahead() -> None:
    policy = PrefetchPolicy(PrefetchTuning(budget_bytes=GIB))
    assert policy.decide(PrefetchAsk(KEY, need(host=8_000), IDLE), 0.0).action is A.PROMOTE


def test_a_lead_at_the_floor_and_an_accuracy_at_the_floor_keep_a_key_on() -> None:
    policy = PrefetchPolicy(PrefetchTuning(min_lead_s=0.05, min_accuracy=0.0))
    policy.observe_lead(KEY, 0.05)
    ask = PrefetchAsk(KEY, need(host=8_000, kv_bytes=1), IDLE)
    for _ in range(6):
        policy.settle(policy.decide(ask, 0.0), used=False)
    assert policy.decide(ask, 0.0).action is A.PROMOTE


def test_accuracy_is_judged_from_the_fifth_settled_prefetch_and_probed_every_sixteenth() -> None:
    policy = PrefetchPolicy()
    ask = PrefetchAsk(KEY, need(host=8_000, kv_bytes=1), IDLE)
    for _ in range(4):
        policy.settle(policy.decide(ask, 0.0), used=False)
    assert policy.decide(ask, 0.0).action is A.PROMOTE  # four are too few to judge
    policy.settle(policy.decide(ask, 0.0), used=False)  # the fifth
    answers = [policy.decide(ask, 0.0).action for _ in range(DEFAULT_PROBE_EVERY)]
    assert answers == [A.SKIP] * (DEFAULT_PROBE_EVERY - 1) + [A.PROMOTE]


def test_leads_are_a_decayed_mean() -> None:
    policy = PrefetchPolicy()
    policy.observe_lead(KEY, 1.0)
    policy.observe_lead(KEY, 3.0)
    decay = 0.5 ** (1 / 50)
    assert policy.lead_s(KEY) == pytest.approx(1.0 + 2.0 / (1.0 + decay))
    policy.observe_lead(KEY, -5.0)  # a turn before its signal: no lead, not a negative one
    lead = policy.lead_s(KEY)
    assert lead is not None and lead > 0


def test_settling_never_leaves_a_tenant_owing_or_with_bytes_it_never_had() -> None:
    policy = PrefetchPolicy()
    for kv_bytes in (0, GIB):  # tenants never charged: nothing owed, nothing left over
        refunded = PrefetchDecision(
            A.PROMOTE, K.HOST_COPY, "x", KEY._replace(tenant="b"), kv_bytes=kv_bytes
        )
        settled = PrefetchDecision(
            A.PROMOTE, K.HOST_COPY, "x", KEY._replace(tenant="c"), kv_bytes=kv_bytes
        )
        policy.refund(refunded, 0.0)
        policy.settle(settled, used=True)
        assert policy.outstanding_bytes("b") == policy.outstanding_bytes("c") == 0
    policy.settle(policy.decide(PrefetchAsk(KEY, need(host=8_000), IDLE), 0.0), used=True)
    assert policy.outstanding_bytes("acme") == 0


def test_the_bucket_is_charged_prefill_after_prefill_at_one_instant() -> None:
    policy = PrefetchPolicy(PrefetchTuning(prefill_burst_s=2.0, prefill_rate=0.25))
    policy.observe_lead(KEY, 1.0)
    ask = PrefetchAsk(KEY, need(prefill_s=0.8), IDLE)
    assert [policy.decide(ask, 10.0).action for _ in range(3)] == [A.PREFILL, A.PREFILL, A.SKIP]
    assert policy.decide(ask, 12.0).action is A.PREFILL  # 0.4 s + 2 s x 0.25


def test_a_key_is_forgotten_least_recently_used_first_past_the_cap() -> None:
    policy = PrefetchPolicy()
    keys = [KEY._replace(tool_class=f"t{i}") for i in range(MAX_KEYS + 1)]
    for k in keys[:MAX_KEYS]:
        policy.observe_lead(k, 1.0)
    assert policy.lead_s(keys[0]) == 1.0  # the cap is not yet passed
    policy.observe_lead(keys[0], 1.0)  # used again: the second is the least recent now
    policy.observe_lead(keys[MAX_KEYS], 1.0)
    assert policy.lead_s(keys[1]) is None
    assert policy.lead_s(keys[0]) == policy.lead_s(keys[MAX_KEYS]) == 1.0


@pytest.mark.parametrize(
    ("tuning", "needle"),
    [
        ({"budget_bytes": -1}, "^prefetch budgets must be >= 0$"),
        ({"prefill_rate": -0.1}, "^prefetch budgets must be >= 0$"),
        ({"prefill_burst_s": -1.0}, "^prefetch budgets must be >= 0$"),
        ({"max_waiting": -1}, r"^max_waiting must be >= 0, min_accuracy in \[0, 1\]$"),
        ({"min_accuracy": 1.5}, r"^max_waiting must be >= 0, min_accuracy in \[0, 1\]$"),
        ({"min_accuracy": -0.1}, r"^max_waiting must be >= 0, min_accuracy in \[0, 1\]$"),
        ({"min_lead_s": -1.0}, r"^min_lead_s must be finite and >= 0, got -1\.0$"),
        ({"min_lead_s": math.inf}, r"^min_lead_s must be finite and >= 0, got inf$"),
    ],
)
def test_bad_settings_are_refused(tuning: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        PrefetchTuning(**tuning)  # type: ignore[arg-type]


def test_the_edges_of_the_settings_are_allowed() -> None:
    PrefetchTuning(
        budget_bytes=0,
        prefill_rate=0.0,
        prefill_burst_s=0.0,
        max_waiting=0,
        min_accuracy=0.0,
        min_lead_s=0.0,
    )
    PrefetchTuning(min_accuracy=1.0)


# --- when a turn becomes likely ---


class Scripted:
    """A wait model that answers from a table of idle times and writes down every ask."""

    def __init__(self, answers: dict[float, float]) -> None:
        self.answers = answers
        self.asked: list[tuple[float, float, float | None]] = []

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook:
        self.asked.append((idle_s, horizon_s, hint_s))
        return Outlook(self.answers.get(idle_s, 0.0), horizon_s)


def test_the_scan_starts_at_the_turns_end_then_walks_the_bins_from_the_least_lead() -> None:
    model = Scripted({})
    assert first_likely_return_s(model, WaitKey("a", "t"), hint_s=7.0, horizon_s=1.0) is None
    idles = [a for a, _, _ in model.asked]
    assert idles[0] == 0.0 and idles[1] == min(e for e in EDGES if e >= DEFAULT_MIN_LEAD_S)
    assert all(h == 7.0 for _, _, h in model.asked)  # the hint is passed on
    assert max(idles) < 1.0  # no idle time at or past the horizon is asked about


def test_the_first_idle_time_at_the_threshold_is_due() -> None:
    edge = next(e for e in EDGES if e > 1.0)
    model = Scripted({edge: 0.6})
    assert first_likely_return_s(model, WaitKey("a", "t"), hint_s=None, horizon_s=edge) is None
    due = first_likely_return_s(model, WaitKey("a", "t"), hint_s=None, horizon_s=edge + 1e-9)
    assert due == edge
    assert Scripted({0.0: 0.6}).outlook(WaitKey("a", "t"), 0.0, 5.0).p_return == 0.6
    assert (
        first_likely_return_s(Scripted({0.0: 0.6}), WaitKey("a", "t"), hint_s=None, horizon_s=10.0)
        == 0.0
    )


def test_the_window_is_a_bin_wide_past_the_minimum_and_no_longer_than_a_hold() -> None:
    model = Scripted({})
    first_likely_return_s(model, WaitKey("a", "t"), hint_s=None, horizon_s=1800.0)
    windows = dict((a, w) for a, w, _ in model.asked)
    ratio = EDGES[1] / EDGES[0]
    for idle_s, window in windows.items():
        assert window == pytest.approx(min(30.0, max(5.0, idle_s * (ratio - 1))))
    assert windows[0.0] == 5.0 and max(windows.values()) == 30.0


# --- restore ahead of the predicted return ---

LATE = [e for e in EDGES if e > 1.0]
"""Bin edges past a second: (LATE[0], LATE[1], ...)."""


def test_a_scan_from_a_later_idle_time_starts_at_its_first_edge_and_not_at_the_end() -> None:
    likely = Scripted({0.0: 0.9, LATE[0]: 0.9, LATE[2]: 0.9})
    k = WaitKey("a", "t")
    assert first_likely_return_s(likely, k, hint_s=None, horizon_s=1800.0) == 0.0
    assert (
        first_likely_return_s(likely, k, hint_s=None, horizon_s=1800.0, after_s=LATE[0]) == LATE[0]
    )
    later = first_likely_return_s(likely, k, hint_s=None, horizon_s=1800.0, after_s=LATE[0] + 1e-9)
    assert later == LATE[2]
    model = Scripted({})
    first_likely_return_s(model, k, hint_s=None, horizon_s=1800.0, after_s=LATE[0])
    assert min(a for a, _, _ in model.asked) == LATE[0]


def test_a_rule_without_a_recheck_is_due_once_a_wait() -> None:
    model = Scripted({0.0: 0.6, LATE[0]: 0.6})
    k = WaitKey("a", "t")
    assert DueRule() == ONCE and ONCE.recheck_s is None
    assert ONCE.next_s(model, k, hint_s=None, horizon_s=1800.0) == 0.0
    assert ONCE.next_s(model, k, hint_s=None, horizon_s=1800.0, after_s=0.0) is None


def test_a_rule_with_a_recheck_is_due_again_from_its_recheck_past_the_last_time() -> None:
    model = Scripted({0.0: 0.6, LATE[0]: 0.6, LATE[1]: 0.6, LATE[3]: 0.6})
    k = WaitKey("a", "t")
    rule = DueRule(recheck_s=LATE[1] - LATE[0])
    assert rule.next_s(model, k, hint_s=None, horizon_s=1800.0) == 0.0
    assert rule.next_s(model, k, hint_s=None, horizon_s=1800.0, after_s=0.0) == LATE[0]
    assert rule.next_s(model, k, hint_s=None, horizon_s=1800.0, after_s=LATE[0]) == LATE[1]
    assert rule.next_s(model, k, hint_s=None, horizon_s=1800.0, after_s=LATE[1]) == LATE[3]
    assert rule.next_s(model, k, hint_s=None, horizon_s=LATE[3], after_s=LATE[1]) is None


def test_a_rule_asks_with_its_window_and_threshold() -> None:
    model = Scripted({0.0: 0.5})
    k = WaitKey("a", "t")
    assert DueRule(window_s=7.0, threshold=0.5).next_s(model, k, hint_s=3.0, horizon_s=60.0) == 0.0
    assert model.asked == [(0.0, 7.0, 3.0)]
    assert DueRule(threshold=0.51).next_s(model, k, hint_s=None, horizon_s=60.0) is None


def test_restoring_ahead_uses_every_signal_and_the_due_times_rechecked_each_second() -> None:
    assert frozenset(PrefetchTrigger) == RESTORE_AHEAD_TRIGGERS
    assert DueRule(DEFAULT_DUE_WINDOW_S, DEFAULT_DUE_THRESHOLD, 1.0) == RESTORE_AHEAD
    assert RESTORE_RECHECK_S == 1.0


class Keyed(Scripted):
    """A scripted wait model that also writes down the keys it is asked about."""

    def __init__(self, answers: dict[float, float]) -> None:
        super().__init__(answers)
        self.keys: list[WaitKey] = []

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook:
        self.keys.append(key)
        return super().outlook(key, idle_s, horizon_s, hint_s)


def test_a_sessions_signals_are_timed_under_the_reapers_key_with_its_hint() -> None:
    waiting = IdleSession(
        "s", 640, 100.0, True, "build", turns=9, expected_wait_s=20.0, tenant="acme"
    )
    model = Keyed({LATE[0]: 0.6})
    hazard = PrefetchTrigger.HAZARD
    assert signal_due_s(ONCE, model, waiting, hazard, horizon_s=1800.0) == LATE[0]
    assert set(model.keys) == {WaitKey("acme", "build", 4)}  # depths past 4 are 4
    assert {h for _, _, h in model.asked} == {None}
    model.asked.clear()
    due = signal_due_s(ONCE, model, waiting, PrefetchTrigger.TOOL_DUE, horizon_s=1800.0)
    assert due == LATE[0] and {h for _, _, h in model.asked} == {20.0}
    model.asked.clear()
    assert signal_due_s(ONCE, model, waiting, PrefetchTrigger.TOOL_DUE, horizon_s=LATE[0]) is None
    assert max(a for a, _, _ in model.asked) < LATE[0]
    rule = DueRule(recheck_s=1.0)
    again = signal_due_s(rule, model, waiting, hazard, horizon_s=1800.0, after_s=LATE[0])
    assert again is None  # nothing likely from a second past it
    unhinted = IdleSession("s", 640, 100.0, True, "build")
    model.asked.clear()
    for trigger in (PrefetchTrigger.TOOL_DUE, PrefetchTrigger.TOOL_FINISHED):
        assert signal_due_s(ONCE, model, unhinted, trigger, horizon_s=1800.0) is None
    assert model.asked == []  # not timed by the model at all
