"""The console's fake appliance says only what the product says: the kinds, codes and
reasons of the fake state are the product's own, and the state fits the API's schema."""

from __future__ import annotations

from appliance.api.admin.schemas import convert_state
from appliance.policy.routing import RouteKind
from appliance.services.operator.session_admin import RELEASE_REASON, RELEASED
from appliance.services.residency.session_kv import NO_DECISION_REASON
from tests.tui.fakes import make_state


def test_the_fake_state_says_only_what_the_product_says() -> None:
    for simulated in (False, True):
        state = make_state(n_sessions=40, tick=3, simulated=simulated)
        convert_state(state)  # the schema the API publishes
        assert state["routing"] and set(state["routing"]) <= {k.value for k in RouteKind}
        shown = {(s["decision"], s["reason"]) for s in state["sessions"]}
        assert shown <= {(None, NO_DECISION_REASON), (RELEASED, RELEASE_REASON)}
        # The host tier the state reports is exercised, not always 0.
        assert any(s["resident_tokens"]["host"] > 0 for s in state["sessions"])
