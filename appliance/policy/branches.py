"""Branch-local state: what a child task's session (a branch of its parent) may keep, and
what becomes of it when the child ends.

Model of the world: a child task forked from its parent starts from the parent's exact
blocks: its first prompt begins with the parent's conversation at the fork, which the
prefix cache shares (never copied). Those `fork_tokens` are the parent's, never charged to
the child; only the child's own tokens past them count, against a per-branch quota
(`quota_bytes`): a residency decision to HOLD or DEMOTE a branch whose own KV is over it
becomes a RELEASE (`ResidencyKind.BRANCH_QUOTA`), so a fan-out of many children cannot
park its contexts in HBM or host memory. When a child ends, however it ends (succeeded,
failed, cancelled, or discarded by its parent), its own held and demoted blocks are
released at once on every tier; the parent's blocks are left where they are.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from appliance.policy.residency import ResidencyAction, ResidencyDecision, ResidencyKind

DEFAULT_BRANCH_QUOTA_BYTES = 2 << 30
"""Judgement: a branch may hold 2 GiB of its own KV (16k tokens of the bundled Llama-3-8B,
a sub-agent's exploration of a few files), about a quarter of a small worker's pool."""


@dataclass(frozen=True, slots=True)
class Branch:
    """A child task's session, forked from its parent's."""

    session_id: str
    parent_id: str
    fork_tokens: int
    """Tokens of the parent's conversation it started from (the parent's blocks)."""


@dataclass(frozen=True, slots=True)
class BranchQuota:
    quota_bytes: int = DEFAULT_BRANCH_QUOTA_BYTES

    def __post_init__(self) -> None:
        if self.quota_bytes < 0:
            raise ValueError(f"a branch quota must be >= 0 bytes, got {self.quota_bytes}")

    def own_tokens(self, branch: Branch, resident_tokens: int) -> int:
        """The branch's own tokens of `resident_tokens`: those past the fork."""
        return max(0, resident_tokens - branch.fork_tokens)

    def bound(self, decision: ResidencyDecision, own_bytes: int) -> ResidencyDecision:
        """The decision, or a RELEASE when it would keep more than the quota of the branch's
        own KV in HBM or on the host tier."""
        keeps = decision.action in (ResidencyAction.HOLD, ResidencyAction.DEMOTE)
        if not keeps or own_bytes <= self.quota_bytes:
            return decision
        return replace(
            decision,
            action=ResidencyAction.RELEASE,
            until_s=None,
            kind=ResidencyKind.BRANCH_QUOTA,
            reason=(
                f"release: the branch's own {own_bytes / 2**20:.0f} MiB pass its "
                f"{self.quota_bytes / 2**20:.0f} MiB quota (was: {decision.reason})"
            ),
        )
