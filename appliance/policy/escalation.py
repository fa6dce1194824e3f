"""Which side a turn goes to: the local box, or an outside endpoint (docs/escalation.md).

The model of the world, in one order of rules, the first that speaks wins:

1. The turn's `X-Escalate` header (when escalation.header is on): an endpoint's name sends it
   there, `local` keeps it here; either way the task's later turns stay on that side.
2. The side a header named for one of the task's earlier turns (`pinned`): the task does
   not wander back.
3. Its task class's rule (escalation.task_classes), the same for each of its turns.
4. Otherwise the local box; and when its admission refuses the turn as `overloaded` or
   `deadline_infeasible` (the box is full or too slow, not the tenant's limits), spill-over
   sends it to the `spill_to` endpoint instead, if its deadline (none: any) allows that
   endpoint's latency and the endpoint has room (`spill_side`). A spilled turn moves alone:
   the task's next turn is judged afresh.

An outside turn's cost is its endpoint's: uncached prompt tokens at its input price, the
prompt tokens it reports cached at its cached price, output tokens at its output price (per
million). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from appliance.domain.errors import ApplianceError

LOCAL = "local"
MTOK = 1_000_000


class UnknownEndpoint(ApplianceError):
    code = "unknown_endpoint"
    http_status = 400


@dataclass(frozen=True, slots=True)
class SideRules:
    endpoints: frozenset[str] = frozenset()
    task_classes: Mapping[str, str] = field(default_factory=dict)
    header: bool = True
    spill_to: str | None = None


@dataclass(frozen=True, slots=True)
class Side:
    """Where a turn goes: `endpoint` None is the local box; `reason` is the ledger's
    `turns.route_reason`; `pin` is what the task's later turns follow (None: no change)."""

    endpoint: str | None
    reason: str
    pin: str | None = None


def choose_side(
    rules: SideRules, *, header: str | None, task_class: str | None, pinned: str | None
) -> Side:
    """The side of one turn (the module docstring's order); raises UnknownEndpoint (400) for
    a header that names no endpoint."""
    if header is not None and rules.header:
        if header == LOCAL:
            return Side(None, "X-Escalate: local", pin=LOCAL)
        if header not in rules.endpoints:
            known = ", ".join(sorted(rules.endpoints)) or "none configured"
            raise UnknownEndpoint(
                f"X-Escalate names {header!r}, which is no escalation endpoint "
                f"(use 'local' or one of: {known})"
            )
        return Side(header, f"X-Escalate: {header}", pin=header)
    if pinned == LOCAL:
        return Side(None, "task stays local (X-Escalate: local)")
    if pinned is not None and pinned in rules.endpoints:
        return Side(pinned, f"task stays on {pinned} (an earlier turn's X-Escalate)")
    # No class finds no rule either way: the test only keeps None from a str-keyed lookup.
    target = None
    if task_class is not None:  # pragma: no mutate
        target = rules.task_classes.get(task_class)
    if target is not None:
        return Side(target, f"task class {task_class} -> {target}")  # stable by itself
    return Side(None, "local")


SPILLED = frozenset({"overloaded", "deadline_infeasible"})
"""Admission's refusals that spill over (the box's load); its other refusals stand."""


def spill_side(
    refused: str, *, spill_to: str | None, latency_s: float, room: bool, deadline_s: float | None
) -> Side | None:
    """The side a turn the local box refused (`refused`: admission's code) spills to, or None
    where it stays refused; `deadline_s`: the seconds its task has left (None: no deadline)."""
    if spill_to is None or refused not in SPILLED or not room:
        return None
    if deadline_s is not None and deadline_s < latency_s:
        return None
    left = "no deadline" if deadline_s is None else f"{deadline_s:.3g} s left"
    return Side(
        spill_to, f"spill-over: box refused ({refused}); {left}, {spill_to} ~{latency_s:.3g} s"
    )


@dataclass(frozen=True, slots=True)
class OutsidePrices:
    """An endpoint's prices per million tokens, in the ledger's currency."""

    input_per_mtok: float = 0.0
    cached_per_mtok: float = 0.0
    output_per_mtok: float = 0.0


def outside_cost(
    prices: OutsidePrices, *, prompt_tokens: int, cached_tokens: int, output_tokens: int
) -> float:
    """What one outside attempt cost at its endpoint's prices."""
    cached = max(0, min(cached_tokens, prompt_tokens))
    return (
        prices.input_per_mtok * max(0, prompt_tokens - cached)
        + prices.cached_per_mtok * cached
        + prices.output_per_mtok * max(0, output_tokens)
    ) / MTOK
