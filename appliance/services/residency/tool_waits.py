"""What a session waits on once its turn has ended, as the idle reaper is told.

Model of the world: an agent's turn ends in an answer; if the answer calls tools the
harness runs them and comes back with their results, else the turn goes back to a person,
who may reply. The answer says which (`answer_tools.py`, read as it passes the forwarder),
so a session waits on the tools its last answer called (its tool class: their names), or
on the person (`PERSON`): either way a wait that ends in a return, never a last step.

The client's headers stay as hints: `X-Tool-Class` or `X-Expected-Tool-Wait-S` on a turn
says it ends in a tool call, and the header's class (and wait) wins for that turn over
what the answer said; both are recorded. A client that sent them on some turn of a session
and sends neither on a later one whose answer calls no tool says that turn is its last step
(the headers' convention, kept); its answer calling a tool says otherwise. Only a turn that
neither names nor says anything (no header, no answer read: an error, a cut stream) is
unknown, as a client that never sent headers was before answers were read.

A `tool_started` task event (its `tool_class` and `expected_s`) comes after the turn has
ended: the task's waiting sessions then wait as a turn with those headers would have said
(`started`), the event named as the source.

Clients name their tools, so the names a tenant's waits are learned under are bounded: its
first `NAMES_PER_TENANT` classes are kept, any later one is learned as `OTHER` (the ledger
still names it), for the `MAX_TENANTS` most recent tenants.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from appliance.policy.residency import IdleSession
from appliance.policy.survival import PERSON
from appliance.services.sessions.answer_tools import AnswerEnd
from appliance.services.sessions.sessions import SessionState

NAMES_PER_TENANT = 64
"""Tool classes a tenant's waits are learned under; later ones are pooled as `OTHER`."""
OTHER = "other"
MAX_TENANTS = 4096
HEADER = "header"
ANSWER = "answer"
EVENT = "event"
STARTED_EVENT = "its task's tool_started event"


@dataclass(frozen=True, slots=True)
class TurnWait:
    """What a session waits on at its turn's end (see the module)."""

    ends_in_tool_call: bool | None
    """True: it is coming back (a tool, or a person); False: its last step; None: unknown."""
    tool_class: str | None = None
    """The class its wait is learned under: the header's, else the answer's (bounded)."""
    expected_wait_s: float | None = None
    """The client's `X-Expected-Tool-Wait-S`."""
    hinted: str | None = None
    """The client's `X-Tool-Class`."""
    answer: AnswerEnd | None = None
    """How its answer ended (None: it did not say)."""
    hinted_by: str = "X-Tool-Class"
    """What gave the hints: the turn's headers, or the task's `tool_started` event."""

    @property
    def answered(self) -> str | None:
        """The answer's class: the tools it called (names joined), `PERSON`, or None."""
        return self.answer.tool_class if self.answer is not None else None

    @property
    def source(self) -> str | None:
        """Where the wait came from: `HEADER`, `ANSWER`, or None (a last step, unknown)."""
        if self.hinted is not None or self.expected_wait_s is not None:
            return EVENT if self.hinted_by == STARTED_EVENT else HEADER
        return ANSWER if self.ends_in_tool_call else None

    def says(self) -> str | None:
        """The wait in words, for its decision's ledger reason; None when nothing is known."""
        if self.ends_in_tool_call is None:
            return None
        answer = _answer_says(self.answer)
        if not self.ends_in_tool_call:
            return f"last step: its client named tools on earlier turns, none now; {answer}"
        wait = "" if self.expected_wait_s is None else f", expected {self.expected_wait_s:g} s"
        named = self.hinted or self.answered
        if self.tool_class != named:  # a tenant's names past the bound
            wait += f"; learned as {self.tool_class}"
        if self.hinted is not None:
            return f"waits on {self.hinted} ({self.hinted_by}{wait}; {answer})"
        if self.tool_class == PERSON:
            return f"waits on the person ({answer}{wait})"
        if self.answered is None:
            return f"waits on a tool ({answer}{wait})"
        return f"waits on tool {self.answered} ({answer}{wait})"

    def applied_to(self, idle: IdleSession) -> IdleSession:
        """The policy's view of a waiting session, waiting on this instead."""
        return replace(
            idle,
            ends_in_tool_call=self.ends_in_tool_call,
            tool_class=self.tool_class,
            expected_wait_s=self.expected_wait_s,
        )

    def figures(self) -> dict[str, Any]:
        """The wait's part of its decision's ledger figures."""
        return {
            "answer_tools": self.answered,
            "header_tool_class": self.hinted,
            "header_wait_s": self.expected_wait_s,
            "wait_from": self.source,
        }


def _answer_says(answer: AnswerEnd | None) -> str:
    if answer is None:
        return "its answer said nothing of tools"
    if not answer.tool_call:
        return "its answer called no tool"
    if not answer.tools:
        return "its answer called a tool of no name"
    return f"its answer called {answer.tool_class}"


UNKNOWN = TurnWait(None)


class ToolWaits:
    """The waits of sessions at their turns' ends: remembers the sessions whose client sent
    the agent headers (the `bound` most recent) and the classes each tenant's waits are
    learned under."""

    def __init__(self, bound: int, *, names_per_tenant: int = NAMES_PER_TENANT) -> None:
        self._bound = bound
        self._speakers: OrderedDict[str, None] = OrderedDict()
        self._names_per_tenant = names_per_tenant
        self._names: OrderedDict[str, set[str]] = OrderedDict()

    def wait_of(self, session: SessionState, key: str) -> TurnWait:
        """What the session (kept under `key`), whose turn just ended, waits on."""
        hinted, hint_s, said = session.tool_class, session.expected_wait_s, session.said
        answered = said.tool_class if said is not None else None
        if hinted is not None or hint_s is not None:
            self._spoke(key)
            learned = self._learned(session.tenant, hinted or answered)
            return TurnWait(True, learned, hint_s, hinted, said)
        if said is not None and (said.tool_call or key not in self._speakers):
            return TurnWait(True, self._learned(session.tenant, answered), answer=said)
        return TurnWait(False if key in self._speakers else None, answer=said)

    def started(
        self,
        session: SessionState,
        key: str,
        wait: TurnWait,
        tool_class: str | None,
        expected_s: float | None,
    ) -> TurnWait:
        """What the session waits on once its task's client says a tool has started: that
        tool (else the one it waited on), with the event's expected wait if it gave one."""
        self._spoke(key)
        hinted = tool_class or wait.hinted or wait.answered
        hint_s = expected_s if expected_s is not None else wait.expected_wait_s
        learned = self._learned(session.tenant, hinted)
        return TurnWait(True, learned, hint_s, hinted, wait.answer, STARTED_EVENT)

    def _spoke(self, key: str) -> None:
        self._speakers[key] = None
        self._speakers.move_to_end(key)
        if len(self._speakers) > self._bound:
            self._speakers.popitem(last=False)

    def _learned(self, tenant: str, tool_class: str | None) -> str | None:
        """The class the tenant's wait is learned under (see the module)."""
        if tool_class is None or tool_class == PERSON:
            return tool_class
        names = self._names.setdefault(tenant, set())
        self._names.move_to_end(tenant)
        if len(self._names) > MAX_TENANTS:
            self._names.popitem(last=False)
        if tool_class not in names and len(names) >= self._names_per_tenant:
            return OTHER
        names.add(tool_class)
        return tool_class
