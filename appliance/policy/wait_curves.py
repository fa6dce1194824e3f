"""Survival curves of waits on fixed log-spaced bins: the log-normal priors, the binned
life table (the actuarial form of Kaplan-Meier's estimator) and the blend of a hint's
curve into the data's. The learning model that feeds them is `appliance.policy.survival`.

Pure: no clock, no I/O, no randomness. Units are seconds.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

MIN_GAP_S = 1e-3
"""Shortest gap the bins tell apart: the workload config's fastest tool (file, min 1 ms)."""
MAX_GAP_S = 86_400.0
"""Longest: a day, beyond any residency worth holding (the config's longest tool: 1 h)."""
N_BINS = 64
"""Bins over 8 decades: each 1.33x the last, a resolution of about +-15% in time."""
_LOG_SPAN = math.log(MAX_GAP_S / MIN_GAP_S)
EDGES = tuple(MIN_GAP_S * math.exp(_LOG_SPAN * i / N_BINS) for i in range(N_BINS + 1))
"""The bins' edges, seconds: bin i holds [EDGES[i], EDGES[i + 1])."""
MIN_SIGMA = 0.05
"""Narrowest log-normal used (a 5% spread), so a perfect record stays a distribution."""
Z95 = 1.6448536269514722
"""The standard normal's 95th percentile: sigma = ln(p95 / median) / Z95."""


def bin_of(t_s: float) -> int:
    """The bin holding t_s, clamped to the bins."""
    return min(max(bisect.bisect_right(EDGES, t_s) - 1, 0), N_BINS - 1)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal wait by its median and sigma (of ln T)."""

    median_s: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.median_s > 0 and math.isfinite(self.median_s)):
            raise ValueError(f"a log-normal needs a positive median, got {self.median_s!r}")
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ValueError(f"a log-normal needs a positive sigma, got {self.sigma!r}")

    @classmethod
    def from_median_p95(cls, median_s: float, p95_s: float) -> LogNormal:
        """As the workload config states a wait (`Dist`); p95 == median is the narrowest."""
        return cls(median_s, max(math.log(p95_s / median_s) / Z95, MIN_SIGMA))

    def survival(self, t_s: float) -> float:
        if t_s <= 0:
            return 1.0
        return 0.5 * math.erfc(math.log(t_s / self.median_s) / (self.sigma * math.sqrt(2)))

    def area(self, a_s: float, b_s: float) -> float:
        return self._tail_area(a_s) - self._tail_area(b_s)

    def _tail_area(self, a_s: float) -> float:
        """E[(T - a)+] = E[T; T > a] - a P(T > a), in closed form."""
        mean = self.median_s * math.exp(self.sigma**2 / 2)
        if a_s <= 0:
            return mean
        z = (math.log(self.median_s / a_s) + self.sigma**2) / self.sigma
        return mean * 0.5 * math.erfc(-z / math.sqrt(2)) - a_s * self.survival(a_s)


DEFAULT_PRIOR = LogNormal.from_median_p95(2.0, 900.0)
"""For a tenant never seen: its 5th..95th percentiles (4 ms..900 s) span the workload
config's tool classes, from file's median (50 ms) to human's p95 (900 s)."""


@dataclass(frozen=True, slots=True)
class WaitCurve:
    """A survival function by its values at `EDGES`, linear between them, flat outside;
    `_cumulative[k]` is its integral from `EDGES[0]` to `EDGES[k]` (trapezoids are exact)."""

    at_edges: array[float]
    _cumulative: array[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total, cumulative = 0.0, array("d", [0.0])
        for (x, y), (sx, sy) in zip(pairwise(EDGES), pairwise(self.at_edges), strict=True):
            total += (y - x) * (sx + sy) / 2
            cumulative.append(total)
        object.__setattr__(self, "_cumulative", cumulative)

    def survival(self, t_s: float) -> float:
        """P(T > t_s)."""
        return self._locate(t_s)[1]

    def area(self, a_s: float, b_s: float) -> float:
        """The integral of P(T > t) over [a_s, b_s]."""
        return self.window(a_s, b_s)[2]

    def window(self, a_s: float, b_s: float) -> tuple[float, float, float]:
        """(`survival(a_s)`, `survival(b_s)`, `area(a_s, b_s)`), each time's bin found once
        (the reaper asks for all three of every held session it ranks)."""
        ka, sa = self._locate(a_s)
        kb, sb = self._locate(b_s)
        if a_s >= MAX_GAP_S or b_s <= MIN_GAP_S or (ka is not None and ka == kb):
            return sa, sb, (b_s - a_s) * (sa + sb) / 2  # within one bin, or outside them
        return sa, sb, self._integral(b_s, kb, sb) - self._integral(a_s, ka, sa)

    def _locate(self, t_s: float) -> tuple[int | None, float]:
        """(t_s's bin, None outside the bins; P(T > t_s))."""
        if t_s <= MIN_GAP_S:
            return None, 1.0
        if t_s >= MAX_GAP_S:
            return None, self.at_edges[-1]
        k = bin_of(t_s)
        frac = (t_s - EDGES[k]) / (EDGES[k + 1] - EDGES[k])
        return k, self.at_edges[k] + (self.at_edges[k + 1] - self.at_edges[k]) * frac

    def _integral(self, t_s: float, k: int | None, s: float) -> float:
        """The integral of P(T > t) from `EDGES[0]` to `t_s` (negative below it), `k` and
        `s` its bin and survival (`_locate`)."""
        if t_s <= MIN_GAP_S:
            return t_s - MIN_GAP_S
        if k is None:
            return self._cumulative[-1] + (t_s - MAX_GAP_S) * self.at_edges[-1]
        return self._cumulative[k] + (t_s - EDGES[k]) * (self.at_edges[k] + s) / 2


@dataclass(frozen=True, slots=True)
class BlendedCurve:
    """trust * hint + (1 - trust) * data, as survival functions."""

    hint: LogNormal
    data: WaitCurve
    trust: float

    def survival(self, t_s: float) -> float:
        w = self.trust
        return w * self.hint.survival(t_s) + (1 - w) * self.data.survival(t_s)

    def area(self, a_s: float, b_s: float) -> float:
        w = self.trust
        return w * self.hint.area(a_s, b_s) + (1 - w) * self.data.area(a_s, b_s)

    def window(self, a_s: float, b_s: float) -> tuple[float, float, float]:
        """As `WaitCurve.window`."""
        w, (sa, sb, area) = self.trust, self.data.window(a_s, b_s)
        return (
            w * self.hint.survival(a_s) + (1 - w) * sa,
            w * self.hint.survival(b_s) + (1 - w) * sb,
            w * self.hint.area(a_s, b_s) + (1 - w) * area,
        )


def life_table(
    events: Sequence[float], censored: Sequence[float], prior: Sequence[float], weight: float
) -> WaitCurve:
    """Product-limit over the bins, the prior's `weight` pseudo-sessions at risk alongside
    the data: `weight * min(S, S_prior)` of them still waiting at a bin's start, ending at
    the prior's hazard there. A censored weight is exposed for half its bin.

    No more pseudo-sessions wait than the estimate says (else a heavy-tailed prior would
    outweigh hundreds of observed sessions deep in the tail), nor than the prior says (else
    a short prior, whose sessions have all ended, would keep ending `weight * S` of them in
    every bin past its reach: 400 sessions of which 3 in 4 never return, against a prior
    of 0.5 s, read P(return) 0.51 instead of 0.25)."""
    waiting = sum(events) + sum(censored)
    s, s_prior, at_edges = 1.0, 1.0, array("d", [1.0])
    for d, c, prior_hazard in zip(events, censored, prior, strict=True):
        pseudo = weight * min(s, s_prior)
        exposed = waiting - c / 2 + pseudo
        if exposed > 0:
            s *= max(0.0, 1.0 - (d + pseudo * prior_hazard) / exposed)
        s_prior *= 1.0 - prior_hazard
        waiting -= d + c
        at_edges.append(s)
    return WaitCurve(at_edges)


def hazards(at_edges: Sequence[float]) -> array[float]:
    """Hazard per bin, P(ends in the bin | waiting at its start), from S at `EDGES`."""
    return array("d", ((a - b) / a if a > 0 else 1.0 for a, b in pairwise(at_edges)))


def prior_hazards(prior: LogNormal) -> array[float]:
    # Mass below the first edge is clamped into the first bin, as gaps are.
    return hazards([1.0, *(prior.survival(e) for e in EDGES[1:])])
