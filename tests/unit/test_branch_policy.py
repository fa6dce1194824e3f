"""Branch-local state, the pure policy: a branch's own tokens are those past its fork, and
a decision that would keep more than its quota of them becomes a release."""

from __future__ import annotations

import pytest

from appliance.policy.branches import Branch, BranchQuota
from appliance.policy.residency import ResidencyAction, ResidencyDecision, ResidencyKind

BRANCH = Branch("p.1", "p", fork_tokens=4096)
HOLD = ResidencyDecision(ResidencyAction.HOLD, "hold", 10.0, ResidencyKind.HOLD_CHEAPEST)
DEMOTE = ResidencyDecision(ResidencyAction.DEMOTE, "demote", kind=ResidencyKind.DEMOTE_CHEAPEST)
EVICT = ResidencyDecision(ResidencyAction.EVICT, "evict", kind=ResidencyKind.LAST_STEP)


@pytest.mark.parametrize(("resident", "own"), [(0, 0), (4096, 0), (5000, 904), (100, 0)])
def test_the_parents_tokens_are_never_the_branchs(resident: int, own: int) -> None:
    assert BranchQuota().own_tokens(BRANCH, resident) == own


@pytest.mark.parametrize(
    ("decision", "own_bytes", "action", "kind"),
    [
        (HOLD, 100, ResidencyAction.HOLD, ResidencyKind.HOLD_CHEAPEST),
        (HOLD, 1000, ResidencyAction.HOLD, ResidencyKind.HOLD_CHEAPEST),
        (HOLD, 1001, ResidencyAction.RELEASE, ResidencyKind.BRANCH_QUOTA),
        (DEMOTE, 1001, ResidencyAction.RELEASE, ResidencyKind.BRANCH_QUOTA),
        (EVICT, 5000, ResidencyAction.EVICT, ResidencyKind.LAST_STEP),
    ],
)
def test_a_branch_keeps_no_more_than_its_quota(
    decision: ResidencyDecision, own_bytes: int, action: ResidencyAction, kind: ResidencyKind
) -> None:
    bounded = BranchQuota(quota_bytes=1000).bound(decision, own_bytes)
    assert (bounded.action, bounded.kind) == (action, kind)
    assert (bounded.until_s is not None) == (action is ResidencyAction.HOLD)
    if kind is ResidencyKind.BRANCH_QUOTA:
        assert "quota" in bounded.reason


def test_a_quota_is_not_negative() -> None:
    with pytest.raises(ValueError, match="quota"):
        BranchQuota(quota_bytes=-1)


def test_a_release_over_the_quota_says_both_sizes_and_what_it_overrides() -> None:
    bounded = BranchQuota(quota_bytes=3 << 20).bound(HOLD, 5 << 20)
    assert bounded.reason == "release: the branch's own 5 MiB pass its 3 MiB quota (was: hold)"


def test_a_quota_of_nothing_is_allowed() -> None:
    assert BranchQuota(quota_bytes=0).bound(HOLD, 1).action is ResidencyAction.RELEASE
