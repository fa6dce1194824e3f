"""Records to rows and back: the SQL each write runs and the parameters it binds."""

from __future__ import annotations

import sqlite3
from typing import Any

from appliance.domain.records import (
    AdmissionEvent,
    CacheEviction,
    CacheReceipt,
    CostMode,
    Price,
    PriceId,
    ResidencyEvent,
    RouteDecisionRecord,
    SessionRecord,
    TaskEvent,
    TaskRecord,
    TurnRecord,
    WorkerPowerEvent,
)
from appliance.domain.usage import PeriodCost, UsagePeriod

INSERT_TASK = """INSERT INTO tasks (task_id, tenant, parent_task_id, task_class, status,
    created_at, deadline_at, budget, max_children) VALUES (?, ?, ?, ?, 'open', ?, ?, ?, ?)"""


def task_params(t: TaskRecord) -> tuple[Any, ...]:
    return (
        t.task_id,
        t.tenant,
        t.parent_task_id,
        t.task_class,
        t.created_at,
        t.deadline_at,
        t.budget,
        t.max_children,
    )


INSERT_TASK_EVENT = """INSERT INTO task_events (task_id, type, at, verified, evidence,
    tool_class, expected_s, cost) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"""


def task_event_params(e: TaskEvent) -> tuple[Any, ...]:
    return (
        e.task_id,
        e.type.value,
        e.at,
        e.verified,
        e.evidence,
        e.tool_class,
        e.expected_s,
        e.cost,
    )


CLOSE_TASK = """UPDATE tasks SET status = ?, verified = ?, evidence = ?, finished_at = ?
    WHERE task_id = ?"""

UPSERT_SESSION = """INSERT INTO sessions (session_id, tenant, task_id, worker, created_at,
    last_active_at) VALUES (?, ?, ?, ?, ?, ?)
    ON CONFLICT (session_id) DO UPDATE SET
        task_id = coalesce(excluded.task_id, sessions.task_id),
        worker = coalesce(excluded.worker, sessions.worker),
        last_active_at = coalesce(excluded.last_active_at, sessions.last_active_at)"""


def session_params(s: SessionRecord) -> tuple[Any, ...]:
    return (s.session_id, s.tenant, s.task_id, s.worker, s.created_at, s.last_active_at)


INSERT_TURN = """INSERT INTO turns (turn_id, tenant, task_id, session_id, parent_task_id,
    worker, model, prompt_tokens, cached_tokens, fresh_tokens, output_tokens,
    reasoning_tokens, predicted_cached_tokens, queue_s, ttft_s, e2e_s, gpu_s, outcome, error,
    started_at, finished_at, tool_cost, price_id, cost, endpoint, route_reason)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""


def turn_params(t: TurnRecord, price_id: PriceId | None, cost: float | None) -> tuple[Any, ...]:
    return (
        t.turn_id,
        t.tenant,
        t.task_id,
        t.session_id,
        t.parent_task_id,
        t.worker,
        t.model,
        t.prompt_tokens,
        t.cached_tokens,
        t.fresh_tokens,
        t.output_tokens,
        t.reasoning_tokens,
        t.predicted_cached_tokens,
        t.queue_s,
        t.ttft_s,
        t.e2e_s,
        t.gpu_s,
        t.outcome.value,
        t.error,
        t.started_at,
        t.finished_at,
        t.tool_cost,
        price_id,
        cost,
        t.endpoint,
        t.route_reason,
    )


UPSERT_RECEIPT = """INSERT INTO cache_receipts (prefix_digest, token_count, model,
    runtime_identity, tenant_domain, worker, tier, created_at, last_used_at, generation)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (prefix_digest, model, runtime_identity, tenant_domain, worker, tier)
    DO UPDATE SET token_count = excluded.token_count,
        last_used_at = max(cache_receipts.last_used_at, excluded.last_used_at),
        generation = max(coalesce(cache_receipts.generation, -1), excluded.generation),
        evicted_at = NULL, evicted_cause = NULL"""
"""A prefix cached again renews its receipt; its generation only moves on (a worker's
generation never goes back, so an older one is a write that arrived late)."""


def receipt_params(r: CacheReceipt) -> tuple[Any, ...]:
    return (
        r.prefix_digest,
        r.token_count,
        r.model,
        r.runtime_identity,
        r.tenant_domain,
        r.worker,
        r.tier.value,
        r.created_at,
        r.last_used_at,
        r.generation,
    )


MARK_EVICTED = """UPDATE cache_receipts SET evicted_at = ?, evicted_cause = ?
    WHERE prefix_digest = ? AND model = ? AND runtime_identity = ? AND tenant_domain = ?
        AND worker = ? AND tier = 'gpu' AND evicted_at IS NULL"""


def eviction_params(e: CacheEviction) -> tuple[Any, ...]:
    return (e.at, e.cause, e.prefix_digest, e.model, e.runtime_identity, e.tenant_domain, e.worker)


INSERT_RESIDENCY = """INSERT INTO residency_events (at, session_id, worker, action, reason,
    tokens, tier, figures) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"""


def residency_params(e: ResidencyEvent) -> tuple[Any, ...]:
    tier = e.tier.value if e.tier is not None else None
    return (e.at, e.session_id, e.worker, e.action, e.reason, e.tokens, tier, e.figures_json)


INSERT_WORKER_POWER = """INSERT INTO worker_power_events (at, worker, action, from_state,
    to_state, duration_s, state_s, gpus, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"""


def worker_power_params(e: WorkerPowerEvent) -> tuple[Any, ...]:
    return (
        e.at,
        e.worker,
        e.action,
        e.from_state,
        e.to_state,
        e.duration_s,
        e.state_s,
        e.gpus,
        e.reason,
    )


INSERT_ADMISSION = """INSERT INTO admission_events (at, tenant, task_id, decision, reason,
    queue_depth) VALUES (?, ?, ?, ?, ?, ?)"""


def admission_params(e: AdmissionEvent) -> tuple[Any, ...]:
    return (e.at, e.tenant, e.task_id, e.decision, e.reason, e.queue_depth)


INSERT_ROUTE_DECISION = """INSERT INTO route_decisions (turn_id, at, worker, reason, candidates)
    VALUES (?, ?, ?, ?, ?)"""


def route_decision_params(d: RouteDecisionRecord) -> tuple[Any, ...]:
    return (d.turn_id, d.at, d.worker, d.reason, d.candidates_json)


INSERT_PRICE = """INSERT INTO prices (effective_from, mode, currency, fresh_per_mtok,
    cached_per_mtok, output_per_mtok, reasoning_per_mtok, gpu_second, energy_per_kwh,
    box_per_hour) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""


def price_params(p: Price) -> tuple[Any, ...]:
    return (
        p.effective_from,
        p.mode.value,
        p.currency,
        p.fresh_per_mtok,
        p.cached_per_mtok,
        p.output_per_mtok,
        p.reasoning_per_mtok,
        p.gpu_second,
        p.energy_per_kwh,
        p.box_per_hour,
    )


SELECT_PRICES = """SELECT price_id, effective_from, mode, currency, fresh_per_mtok,
    cached_per_mtok, output_per_mtok, reasoning_per_mtok, gpu_second, energy_per_kwh,
    box_per_hour FROM prices ORDER BY price_id"""


def load_prices(conn: sqlite3.Connection) -> list[Price]:
    return [
        Price(
            price_id=PriceId(r[0]),
            effective_from=r[1],
            mode=CostMode(r[2]),
            currency=r[3],
            fresh_per_mtok=r[4],
            cached_per_mtok=r[5],
            output_per_mtok=r[6],
            reasoning_per_mtok=r[7],
            gpu_second=r[8],
            energy_per_kwh=r[9],
            box_per_hour=r[10],
        )
        for r in conn.execute(SELECT_PRICES)
    ]


INSERT_USAGE_PERIOD = """INSERT INTO usage_periods (started_at, ended_at, price_id, box_cost)
    VALUES (?, ?, ?, ?)"""
INSERT_WORKER_USAGE = """INSERT INTO worker_usage (period_id, worker, gpus, awake_s, busy_s,
    energy_j, idle_cost, energy_cost) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"""


def worker_usage_params(
    period_id: int, period: UsagePeriod, cost: PeriodCost
) -> list[tuple[Any, ...]]:
    return [
        (period_id, w.worker, w.gpus, w.awake_s, w.busy_s, w.energy_j, idle, energy)
        for w, (idle, energy) in zip(period.workers, cost.by_worker, strict=True)
    ]
