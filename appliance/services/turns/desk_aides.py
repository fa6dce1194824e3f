"""What the turn desk consults beside its books (admission, the worker reaper's wake,
escalation, deadline shares, its tokenizer port, turns in flight), built before the desk and
handed to it whole."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.services.escalation.service import Escalation
from appliance.services.tasks.admission import AdmissionService
from appliance.services.tasks.task_paces import TaskPaces
from appliance.services.tasks.task_state import TaskTurnSubscriber
from appliance.services.turns.flights import Flights
from appliance.services.turns.turn import TurnTokenizer
from appliance.services.workers.worker_reaper import WorkerReaperLoop


@dataclass(frozen=True, slots=True)
class TurnDeskAides:
    """What the turn desk consults beside its books, each optional: built before the desk
    and handed to it whole (nothing is joined to a desk once built)."""

    admission: AdmissionService | None = None
    """Admits or refuses each turn (None: every turn is admitted, priority 0)."""
    worker_reaper: WorkerReaperLoop | None = None
    """Wakes a worker for a turn when none is awake (None: workers never rest)."""
    escalation: Escalation | None = None
    """Outside endpoints (None: none, every turn is local)."""
    paces: TaskPaces | None = None
    """Each turn's share of its task's deadline (None: one of the desk's own)."""
    tokenizer: TurnTokenizer | None = None
    """Tokenises its turns (the API's adapter; None: turns come tokenised, `prompt_ids` set)."""
    subscribers: tuple[TaskTurnSubscriber, ...] = ()
    """Hear of each turn's beginning and end after the task book (which always does)."""
    flights: Flights | None = None
    """Turns in flight, their cancellation and deadlines (None: on the event loop's timers)."""
