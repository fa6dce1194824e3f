"""What the API's routes share: the services they call and the guard around each handler."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from appliance.api.admin.admin_sessions import SessionAdmin
from appliance.api.auth import Keys
from appliance.api.turns.requests import Tokenizer
from appliance.ports import Clock, WorkerEndpoint
from appliance.services.operator.state import StateSnapshot
from appliance.services.tasks.admission import AdmissionService
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.turn_desk import TurnDesk

Handler = Callable[[Request], Any]
Guard = Callable[[Handler], Handler]
"""Wraps a handler so that an error becomes the right JSON answer, never a traceback."""


@dataclass
class ApiContext:
    desk: TurnDesk
    """A model turn's whole order, from here to its last record."""
    tasks: TaskBook
    tokenizer: Tokenizer
    keys: Keys
    clock: Clock
    model: str
    max_model_len: int
    state: Callable[[], StateSnapshot]
    """The facts `/admin/v1/state` publishes (appliance/api/admin/state_document.py)."""
    healthy: Callable[[], bool]
    """Whether any worker serves, or rests on purpose and can be woken (`/health`: constant
    time, not the whole state; appliance.domain.worker.can_serve)."""
    ledger_failing: Callable[[], str | None]
    """Why the ledger cannot write now (`/health` is then degraded), or None."""
    metrics: Callable[[], str]
    costs: Callable[[], list[dict[str, Any]]]
    """Cost per successful task by task class and tenant, read from the ledger."""
    admission: AdmissionService | None = None
    """Judges every new task and model turn before anything reaches a worker; None: all pass."""
    sessions_admin: SessionAdmin | None = None
    """One session's detail and its release (`/admin/v1/sessions/{id}`); None: no routes."""
    workers: Callable[[], Sequence[WorkerEndpoint]] = tuple
    """The workers now: a chained Responses turn needs the same worker, not restarted."""
    model_aliases: Mapping[str, str] = field(default_factory=dict)
    """Model names clients may send for `model` (`*`: any name), `api.model_aliases`."""
