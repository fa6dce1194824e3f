"""How long a waiting agent session stays away: a survival model of tool waits.

Model of the world: a session's turn ends, a tool runs (milliseconds to hours), then the
session's next turn arrives, or never does. The gap T between a turn's end and the next
turn has a distribution per key (tenant, tool class, the session's depth in turns) that
drifts as tools and clients change. A session that was abandoned, or released at the
maximum residency before it came back, tells only that T > its idle time: a censored
observation, which must not be counted as a gap of that length (that would make waits
look shorter than they are).

The estimator: a life table (the actuarial form of Kaplan-Meier's product-limit
estimator) over `N_BINS` fixed log-spaced bins from `MIN_GAP_S` to `MAX_GAP_S`. Per bin
it keeps the weight of gaps that ended there (d) and of sessions censored there (c); the
hazard of bin i is d_i / (n_i - c_i / 2), n_i the weight still waiting at the bin's
start (a censored session counts half: it waited through half the bin on average), and
S(t) is the product of (1 - hazard) over the bins before t, linear within a bin (gaps
uniform within it). Every observation of a key first multiplies that key's counts by
2^(-1 / half_life_obs), so the model forgets at a fixed rate in observations and follows
drift; memory per key is fixed (two arrays of `N_BINS`).

A tool class's prior (a log-normal, from a median and p95 like the workload config's
`Dist`) enters as `prior_weight` pseudo-sessions, never forgotten, that wait alongside the
data (prior_weight * min(S(t), S_prior(t)) of them still waiting at t: no more than
either says, see `life_table`) and end at the prior's hazard. So the prior's share of a
bin's hazard is at most prior_weight / (n + prior_weight) with n sessions observed: a class
seen a few times answers from its prior, a well-observed one from its data, and past the
longest gap seen the prior alone sets the hazard. A key not seen yet answers from its class's prior;
a tool's class without one from the tenant's pool of tool waits (`ANY_TOOL`: every
observation of a class but `PERSON`), and a class without a prior not pooled there yet,
`PERSON`, none, or a name over `MAX_CLASS_LEN` characters (never kept), from the
tenant-wide model (every observation of the tenant); a tenant not seen yet from
`DEFAULT_PRIOR`. A class without a prior takes the hazards of the tenant's tool pool (for
`PERSON`: of the tenant-wide model), as they stand when the class is first seen, as its
prior. So a tool named for the first time is expected back like the tenant's other tools,
a person's reply is not. A depth (1..`MAX_DEPTH` turns so far) is a key of its own beside
its depth-less key, fed alike, with the depth-less key's hazards when the depth is first
seen as its prior, and answers for its sessions once it has data: a session on its first
turn and one on its fifth leave (and return) alike within a class only if the data says so.

The client's hint (`X-Expected-Tool-Wait-S`) is judged by its record: per key, the
decayed mean and spread of log(gap / hint) and of log(gap) over hinted returns. Trust is
the share of the gap's log-variance the hint explains, shrunk towards 0 for few samples;
with a hint, answers blend a log-normal at hint * exp(mean log-ratio) with the learned
spread into the data's curve, by that trust.

Units are seconds throughout. Pure: no clock (every call takes its times), no I/O, no
randomness. Bad times (NaN, infinite, negative) raise ValueError; times outside the bins
are clamped to them.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from appliance.policy.wait_curves import (
    DEFAULT_PRIOR,
    MAX_GAP_S,
    MIN_GAP_S,
    MIN_SIGMA,
    N_BINS,
    BlendedCurve,
    LogNormal,
    WaitCurve,
    bin_of,
    hazards,
    life_table,
    prior_hazards,
)

HALF_LIFE_OBS = 200.0
"""Judgement: an estimate from about 290 recent gaps (+-0.03 on a probability) that follows
a change within a few hundred turns of a key."""
PRIOR_WEIGHT = 10.0
"""Judgement: a class's prior counts as 10 gaps, so the data has the larger say from 10."""
MAX_KEYS = 4096
"""Keys kept, least recently used dropped first: about 3 KiB each, 12 MiB in all."""
MAX_CLASS_LEN = 64
"""Longest tool class name kept (the workload config's limit on names)."""
PERSON = "person"
"""The class of a wait on a person (an answer that called no tool): never pooled with the
tenant's tool waits."""
ANY_TOOL = ""  # pragma: no mutate (any name no caller can pass: `_known` takes "" for none)
"""The class of a tenant's pool of tool waits: the empty name, which no caller's class can
be (an empty class is no class)."""
HINT_SAMPLES_FOR_HALF_TRUST = 5.0
"""Judgement: a hint's record earns half its trust after 5 hinted returns."""
MAX_DEPTH = 4
"""Depths told apart: a session's 1st, 2nd, 3rd, and 4th or later turn. On the Mooncake
conversation trace 25 / 39 / 50 / 66 % of sessions come back after their 1st / 2nd / 3rd /
4th-or-later turn: how deep a session is says how likely it is to return."""
_NEGLIGIBLE = 1e-12


class WaitKey(NamedTuple):
    tenant: str
    tool_class: str | None
    """None (or a name not kept): unknown, answered by the tenant-wide model."""
    depth: int = 0
    """The session's turns so far, this one included, capped at `MAX_DEPTH`; 0: unknown."""


class Outlook(NamedTuple):
    """An idle session's prospects over a horizon (`WaitSurvival.outlook`)."""

    p_return: float
    expected_wait_s: float


def depth_of(turns: int | None) -> int:
    """A session's turns so far as a key's depth: 1..`MAX_DEPTH`, 0 when unknown."""
    return 0 if turns is None or turns < 1 else min(turns, MAX_DEPTH)


def _seconds(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return value


class _Moments:
    """Mean and variance of x under exponential forgetting (West's weighted update)."""

    __slots__ = ("m2", "mean", "weight")

    def __init__(self) -> None:
        self.weight, self.mean, self.m2 = 0.0, 0.0, 0.0

    def add(self, x: float, decay: float) -> None:
        self.weight = self.weight * decay + 1
        self.m2 *= decay
        delta = x - self.mean
        self.mean += delta / self.weight
        self.m2 += delta * (x - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / self.weight if self.weight else 0.0


class _KeyModel:
    """One key's decayed life table, its prior's hazards and its hint record."""

    __slots__ = ("_curve", "censored", "events", "hint_ratio", "log_gap", "prior", "prior_weight")

    def __init__(self, prior: Sequence[float], prior_weight: float) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.events = array("d", [0.0]) * N_BINS
        self.censored = array("d", [0.0]) * N_BINS
        self.hint_ratio = _Moments()  # log(gap / hint)
        self.log_gap = _Moments()  # log(gap), same samples: what the hint must explain
        self._curve: WaitCurve | None = None

    def add(self, t_s: float, *, censored: bool, decay: float) -> None:
        if decay < 1:
            for i in range(N_BINS):
                self.events[i] *= decay
                self.censored[i] *= decay
        (self.censored if censored else self.events)[bin_of(t_s)] += 1
        self._curve = None

    def add_hint(self, gap_s: float, hint_s: float, decay: float) -> None:
        self.hint_ratio.add(math.log(gap_s / hint_s), decay)
        self.log_gap.add(math.log(gap_s), decay)

    def curve(self) -> WaitCurve:
        if self._curve is None:
            self._curve = life_table(self.events, self.censored, self.prior, self.prior_weight)
        return self._curve

    def trust(self) -> float:
        n, spread = self.hint_ratio.weight, self.log_gap.var
        if spread <= 0:
            return 0.0
        explained = max(0.0, 1.0 - self.hint_ratio.var / spread)
        return explained * n / (n + HINT_SAMPLES_FOR_HALF_TRUST)


class WaitSurvival:
    """Survival of tool waits per (tenant, tool class), learned online; see the module."""

    def __init__(
        self,
        priors: Mapping[str, LogNormal] | None = None,
        *,
        default_prior: LogNormal = DEFAULT_PRIOR,
        prior_weight: float = PRIOR_WEIGHT,
        half_life_obs: float = HALF_LIFE_OBS,
        max_keys: int = MAX_KEYS,
    ) -> None:
        """`priors`: tool class -> its wait; `half_life_obs` may be math.inf (no forgetting)."""
        if not (prior_weight > 0 and math.isfinite(prior_weight)):
            raise ValueError(f"prior_weight must be positive and finite, got {prior_weight!r}")
        if not half_life_obs > 0:
            raise ValueError(f"half_life_obs must be positive, got {half_life_obs!r}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys!r}")
        self._decay = 0.5 ** (1 / half_life_obs)
        self._max_keys = max_keys
        self._prior_weight = prior_weight
        self._default = prior_hazards(default_prior)
        self._priors = {c: prior_hazards(p) for c, p in (priors or {}).items()}
        self._unobserved: dict[str | None, _KeyModel] = {}  # prior-only answers, never fed
        self._models: OrderedDict[WaitKey, _KeyModel] = OrderedDict()

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, key: object) -> bool:
        return key in self._models

    def observe_gap(self, key: WaitKey, gap_s: float, hint_s: float | None = None) -> None:
        """The session came back `gap_s` after its turn ended; `hint_s` its client's hint."""
        gap_s = _clamp(_seconds("gap_s", gap_s))
        hint_s = None if hint_s is None else _clamp(_seconds("hint_s", hint_s))
        for model in self._models_fed_by(key):
            model.add(gap_s, censored=False, decay=self._decay)
            if hint_s is not None:
                model.add_hint(gap_s, hint_s, self._decay)

    def observe_censored(self, key: WaitKey, idle_s: float) -> None:
        """The session was still away after `idle_s` (released, abandoned): T > idle_s."""
        idle_s = _clamp(_seconds("idle_s", idle_s))
        for model in self._models_fed_by(key):
            model.add(idle_s, censored=True, decay=self._decay)

    def p_return_within(
        self, key: WaitKey, idle_s: float, t_s: float, hint_s: float | None = None
    ) -> float:
        """P(next turn within the next `t_s` | away for `idle_s` so far): `outlook`'s."""
        return self.outlook(key, idle_s, _seconds("t_s", t_s), hint_s).p_return

    def outlook(
        self, key: WaitKey, idle_s: float, horizon_s: float, hint_s: float | None = None
    ) -> Outlook:
        """P(next turn within the next `horizon_s`) and E[min(remaining wait, horizon_s)],
        both given away for `idle_s` so far, from one lookup of the key's curve."""
        idle_s, horizon_s = _seconds("idle_s", idle_s), _seconds("horizon_s", horizon_s)
        now, later, area = self._curve(key, hint_s).window(idle_s, idle_s + horizon_s)
        if now <= _NEGLIGIBLE:  # past everything the model has seen: not coming back
            return Outlook(0.0, horizon_s)
        return Outlook(min(1.0, max(0.0, 1.0 - later / now)), min(horizon_s, area / now))

    def hint_trust(self, key: WaitKey) -> float:
        """0..1: how far this key's hints have earned a say in its answers."""
        return self._answering(key).trust()

    def _curve(self, key: WaitKey, hint_s: float | None) -> WaitCurve | BlendedCurve:
        model = self._answering(key)
        if hint_s is None:
            return model.curve()
        hint_s, trust = _clamp(_seconds("hint_s", hint_s)), model.trust()
        if trust <= 0:
            return model.curve()
        median_s = hint_s * math.exp(model.hint_ratio.mean)
        spread = max(math.sqrt(model.hint_ratio.var), MIN_SIGMA)
        return BlendedCurve(LogNormal(median_s, spread), model.curve(), trust)

    def _answering(self, key: WaitKey) -> _KeyModel:
        """The key's own model at its depth, else at any depth, else its class's prior, else
        the tenant's (at its depth, else at any), else the default."""
        tool_class = _known(key.tool_class)
        if key.depth:  # the key itself unless its class is not kept (no new key: a hot path)
            at_depth = key if tool_class == key.tool_class else key._replace(tool_class=None)
            own = self._touch(at_depth)
            if own is not None:
                return own
        if tool_class is None:
            return self._tenant_wide(key.tenant)
        own = self._touch(WaitKey(key.tenant, tool_class))
        if own is not None:
            return own
        if tool_class in self._priors:
            return self._prior_only(tool_class)
        pooled = self._touch(WaitKey(key.tenant, ANY_TOOL)) if tool_class != PERSON else None
        return pooled or self._tenant_wide(key.tenant)

    def _tenant_wide(self, tenant: str) -> _KeyModel:
        return self._touch(WaitKey(tenant, None)) or self._prior_only(None)

    def _models_fed_by(self, key: WaitKey) -> list[_KeyModel]:
        """Most specific first, then a tool's pool (of no depth): a depth's model is created
        with its key's hazards as they stand, before this observation joins them."""
        tool_class = _known(key.tool_class)
        keys = [WaitKey(key.tenant, tool_class)] if tool_class is not None else []
        keys.append(WaitKey(key.tenant, None))
        if key.depth:
            keys = [k._replace(depth=key.depth) for k in keys] + keys
        if tool_class is not None and tool_class != PERSON:
            keys.append(WaitKey(key.tenant, ANY_TOOL))
        return [self._touch_or_add(k) for k in keys]

    def _touch(self, key: WaitKey) -> _KeyModel | None:
        model = self._models.get(key)
        if model is not None:
            self._models.move_to_end(key)
        return model

    def _touch_or_add(self, key: WaitKey) -> _KeyModel:
        model = self._touch(key)
        if model is None:
            model = self._models[key] = _KeyModel(self._prior_for(key), self._prior_weight)
            while len(self._models) > self._max_keys:
                self._models.popitem(last=False)
        return model

    def _prior_only(self, tool_class: str | None) -> _KeyModel:
        if tool_class not in self._unobserved:
            prior = self._priors[tool_class] if tool_class else self._default
            self._unobserved[tool_class] = _KeyModel(prior, self._prior_weight)
        return self._unobserved[tool_class]

    def _prior_for(self, key: WaitKey) -> Sequence[float]:
        """At a depth: the hazards the key answers with at any depth now. Else its class's
        prior, else the hazards now of the tenant's tool pool (not for `PERSON`, nor the pool
        itself) or its tenant-wide model, else the default."""
        if key.depth:
            return hazards(self._answering(key._replace(depth=0)).curve().at_edges)
        if key.tool_class is None:
            return self._default
        if key.tool_class in self._priors:
            return self._priors[key.tool_class]
        like = self._models.get(WaitKey(key.tenant, ANY_TOOL))
        if like is None or key.tool_class == PERSON:
            like = self._models.get(WaitKey(key.tenant, None))
        return self._default if like is None else hazards(like.curve().at_edges)


def _known(tool_class: str | None) -> str | None:
    """The class as a key, or None: unknown (missing, empty, or too long to keep)."""
    return tool_class if tool_class and len(tool_class) <= MAX_CLASS_LEN else None


def _clamp(t_s: float) -> float:
    return min(max(t_s, MIN_GAP_S), MAX_GAP_S)
