"""Residency policies by the names the CLI and the replay take."""

from __future__ import annotations

from collections.abc import Mapping

from appliance.policy.reaper import Reaper
from appliance.policy.residency import Lru, ResidencyPolicy, TtlPin
from appliance.policy.wait_curves import LogNormal

RESIDENCY_NAMES = ("lru", "ttl-pin", "reaper")


def residency_policy(
    name: str, *, priors: Mapping[str, LogNormal] | None = None
) -> ResidencyPolicy:
    """`lru`, `ttl-pin` (TTL `DEFAULT_PIN_TTL_S`), `ttl-pin:SECONDS` or `reaper` (its
    defaults; `priors`: tool class -> its wait, else the default wait prior); ValueError
    else."""
    base, sep, arg = name.partition(":")
    if base == "lru" and not sep:
        return Lru()
    if base == "reaper" and not sep:
        return Reaper(priors=priors)
    if base == "ttl-pin":
        if not sep:
            return TtlPin()
        try:
            ttl_s = float(arg)
        except ValueError:
            raise ValueError(f"ttl-pin:SECONDS needs a number of seconds, got {arg!r}") from None
        return TtlPin(ttl_s, name=f"ttl-pin:{ttl_s:g}")
    raise ValueError(
        f"unknown residency policy {name!r}; known: lru, ttl-pin, ttl-pin:SECONDS, reaper"
    )
