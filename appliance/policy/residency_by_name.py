"""Residency policies by the names the CLI and the replay take (the anchors `lru`, `ttl-pin` and
`mori`, the appliance's `reaper`), with the reaper's options:
restore on lead time (`+lead-time`, `appliance.policy.prefetch`) and branch-local state
(`+branches`, `appliance.policy.branches`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from appliance.policy.branches import BranchQuota
from appliance.policy.mori import Mori
from appliance.policy.prefetch import PrefetchPolicy, PrefetchTrigger, PrefetchTuning
from appliance.policy.reaper import Reaper, ReaperTuning
from appliance.policy.residency import Lru, ResidencyPolicy, TtlPin
from appliance.policy.wait_curves import LogNormal

RESIDENCY_NAMES = ("lru", "ttl-pin", "mori", "reaper", "reaper+lead-time", "reaper+branches")
LEAD_TIME = "lead-time"
BRANCHES = "branches"
_KNOWN = (
    "lru, ttl-pin, ttl-pin:SECONDS, mori, reaper, reaper+lead-time[:TRIGGER,...], reaper+branches "
    f"(both may be given; triggers: {', '.join(PrefetchTrigger)})"
)


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    """A residency policy and the reaper's options the name asked for."""

    policy: ResidencyPolicy
    prefetch: PrefetchPolicy | None = None
    branches: BranchQuota | None = None


def residency_policy(
    name: str,
    *,
    priors: Mapping[str, LogNormal] | None = None,
    tuning: ReaperTuning | None = None,
) -> ResidencyPolicy:
    """The residency policy of a name (`residency_plan`), without its options."""
    return residency_plan(name, priors=priors, tuning=tuning).policy


def residency_plan(
    name: str,
    *,
    priors: Mapping[str, LogNormal] | None = None,
    tuning: ReaperTuning | None = None,
) -> ResidencyPlan:
    """`lru`, `ttl-pin` (TTL `DEFAULT_PIN_TTL_S`), `ttl-pin:SECONDS`, `mori` or `reaper` (its
    defaults, or `tuning`; `priors`: tool class -> its wait, else the default wait prior),
    the reaper with `+lead-time` (the default triggers, or `+lead-time:TRIGGER,...` those)
    and/or `+branches`;
    ValueError else."""
    base, *options = name.split("+")
    prefetch: PrefetchPolicy | None = None
    branches: BranchQuota | None = None
    for option in options:
        what, sep, arg = option.partition(":")
        if what == LEAD_TIME and prefetch is None:
            ahead = PrefetchTuning(triggers=_triggers(arg)) if sep else PrefetchTuning()
            prefetch = PrefetchPolicy(ahead)
        elif what == BRANCHES and branches is None and not sep:
            branches = BranchQuota()
        else:
            raise ValueError(f"unknown residency option {option!r} in {name!r}; known: {_KNOWN}")
    if options and base != "reaper":
        raise ValueError(f"{name!r}: only the reaper takes +lead-time or +branches")
    if options:
        return ResidencyPlan(Reaper(priors=priors, tuning=tuning, name=name), prefetch, branches)
    return ResidencyPlan(_base(base, priors, tuning))


def _base(
    name: str, priors: Mapping[str, LogNormal] | None, tuning: ReaperTuning | None
) -> ResidencyPolicy:
    base, sep, arg = name.partition(":")
    if base == "lru" and not sep:
        return Lru()
    if base == "mori" and not sep:
        return Mori()
    if base == "reaper" and not sep:
        return Reaper(priors=priors, tuning=tuning)
    if base == "ttl-pin":
        if not sep:
            return TtlPin()
        try:
            ttl_s = float(arg)
        except ValueError:
            raise ValueError(f"ttl-pin:SECONDS needs a number of seconds, got {arg!r}") from None
        return TtlPin(ttl_s, name=f"ttl-pin:{ttl_s:g}")
    raise ValueError(f"unknown residency policy {name!r}; known: {_KNOWN}")


def _triggers(arg: str) -> frozenset[PrefetchTrigger]:
    try:
        return frozenset(PrefetchTrigger(t) for t in arg.split(","))
    except ValueError:
        raise ValueError(
            f"lead-time triggers are {', '.join(PrefetchTrigger)}, got {arg!r}"
        ) from None
