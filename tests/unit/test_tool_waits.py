"""What a session waits on at its turn's end, from its answer and its client's hints, and
the bound on the tool names a tenant's waits are learned under."""

from __future__ import annotations

from appliance.domain.records import SessionId, TenantId
from appliance.services.residency.tool_waits import NAMES_PER_TENANT, OTHER, ToolWaits, TurnWait
from appliance.services.sessions.answer_tools import TO_PERSON, AnswerEnd
from appliance.services.sessions.sessions import SessionState


def ended(
    tenant: str = "acme",
    sid: str = "s",
    *,
    said: AnswerEnd | None = None,
    tool: str | None = None,
    wait_s: float | None = None,
) -> SessionState:
    s = SessionState(TenantId(tenant), SessionId(sid), created_at=0.0)
    s.said, s.tool_class, s.expected_wait_s = said, tool, wait_s
    return s


def calls(*names: str) -> AnswerEnd:
    return AnswerEnd(True, tuple(sorted(names)))


def test_the_answer_says_what_the_session_waits_on() -> None:
    waits = ToolWaits(10)
    assert waits.wait_of(ended(said=calls("grep")), "k") == TurnWait(
        True, "grep", answer=calls("grep")
    )
    person = waits.wait_of(ended(said=TO_PERSON), "k")
    assert (person.ends_in_tool_call, person.tool_class, person.source) == (
        True,
        "person",
        "answer",
    )
    nameless = waits.wait_of(ended(said=AnswerEnd(True)), "k")
    assert (nameless.ends_in_tool_call, nameless.tool_class) == (True, None)
    assert nameless.says() == "waits on a tool (its answer called a tool of no name)"
    assert waits.wait_of(ended(), "k") == TurnWait(None)


def test_a_tenants_first_tool_names_are_kept_and_the_rest_pooled_as_other() -> None:
    waits = ToolWaits(10)
    for i in range(NAMES_PER_TENANT):
        assert waits.wait_of(ended(said=calls(f"t{i}")), "k").tool_class == f"t{i}"
    late = waits.wait_of(ended(said=calls("late")), "k")
    assert (late.tool_class, late.answered) == (OTHER, "late")
    assert late.says() == "waits on tool late (its answer called late; learned as other)"
    header = waits.wait_of(ended(tool="late-header"), "k3")  # the client's names count too
    assert header.tool_class == OTHER and header.hinted == "late-header"
    assert header.says() == (
        "waits on late-header (X-Tool-Class; learned as other; its answer said nothing of tools)"
    )
    assert waits.wait_of(ended(said=calls("t0")), "k").tool_class == "t0"  # a kept one stays
    assert waits.wait_of(ended(said=TO_PERSON), "k").tool_class == "person"  # never counted
    other_tenant = waits.wait_of(ended("globex", said=calls("late")), "k2")
    assert other_tenant.tool_class == "late"  # each tenant its own names


def test_a_headers_hints_win_and_the_answer_is_kept_beside_them() -> None:
    waits = ToolWaits(10)
    both = waits.wait_of(ended(said=calls("grep"), tool="search", wait_s=2.5), "k")
    assert (both.tool_class, both.expected_wait_s, both.answered) == ("search", 2.5, "grep")
    assert both.figures() == {
        "answer_tools": "grep",
        "header_tool_class": "search",
        "header_wait_s": 2.5,
        "wait_from": "header",
    }
    only_wait = waits.wait_of(ended(said=calls("grep"), wait_s=2.5), "k")
    assert (only_wait.tool_class, only_wait.source) == ("grep", "header")


def test_a_header_speaker_ends_on_a_turn_that_names_nothing_and_calls_no_tool() -> None:
    waits = ToolWaits(10)
    waits.wait_of(ended(tool="api"), "k")
    assert waits.wait_of(ended(said=TO_PERSON), "k").ends_in_tool_call is False
    assert waits.wait_of(ended(), "k").ends_in_tool_call is False
    assert waits.wait_of(ended(said=calls("grep")), "k").ends_in_tool_call is True
    assert waits.wait_of(ended(said=TO_PERSON), "other-key").ends_in_tool_call is True


def test_the_header_speakers_remembered_are_bounded() -> None:
    waits = ToolWaits(2)
    for key in ("a", "b", "c"):
        waits.wait_of(ended(tool="api"), key)
    assert waits.wait_of(ended(), "a").ends_in_tool_call is None  # forgotten: unknown again
    assert waits.wait_of(ended(), "c").ends_in_tool_call is False
