"""The survival model of tool waits, fed seeded samples from known distributions: each
estimate is checked against the distribution's exact answer within a stated error."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from itertools import pairwise

import pytest

from appliance.policy.survival import MAX_CLASS_LEN, MAX_DEPTH, WaitKey, WaitSurvival, depth_of
from appliance.policy.wait_curves import DEFAULT_PRIOR, EDGES, MAX_GAP_S, LogNormal
from appliance.workload.spec import WorkloadSpec

PRIORS = {
    name: LogNormal.from_median_p95(dist.median, dist.p95)
    for name, dist in WorkloadSpec().tool_classes.items()
}
KEY = WaitKey("acme", "probe")  # a class without a prior: the default one, outweighed by data
DAY = 86_400.0

Draw = Callable[[random.Random], float]
Survival = Callable[[float], float]


def fed(draw: Draw, n: int, *, seed: int, key: WaitKey = KEY, **kw: float) -> WaitSurvival:
    model = WaitSurvival(PRIORS, **{"half_life_obs": math.inf, **kw})  # type: ignore[arg-type]
    rng = random.Random(seed)
    for _ in range(n):
        model.observe_gap(key, draw(rng))
    return model


def lognormal(median: float, sigma: float) -> Draw:
    return lambda rng: rng.lognormvariate(math.log(median), sigma)


def lognormal_survival(median: float, sigma: float) -> Survival:
    return lambda t: (
        0.5 * math.erfc(math.log(t / median) / (sigma * math.sqrt(2))) if t > 0 else 1.0
    )


def p_within(survival: Survival, idle_s: float, t_s: float) -> float:
    return 1 - survival(idle_s + t_s) / survival(idle_s)


def remaining(survival: Survival, idle_s: float, horizon_s: float, steps: int = 20_000) -> float:
    """E[min(T - idle, horizon) | T > idle]: trapezoids on a grid dense near idle."""
    xs = [idle_s + horizon_s * (k / steps) ** 3 for k in range(steps + 1)]
    area = sum((b - a) * (survival(a) + survival(b)) / 2 for a, b in pairwise(xs))
    return area / survival(idle_s)


def test_exponential_waits_have_a_constant_hazard() -> None:
    # 5,000 gaps, mean 10 s. At idle 20 s about 680 are left: the binomial error of P is
    # 0.019 there, so 0.05 is 2.6 standard errors (reached: 0.027); the mean remaining has
    # an error of 10/sqrt(680) = 0.4 s, so 8% is 2 of them (reached: 4.4%).
    model = fed(lambda rng: rng.expovariate(0.1), 5000, seed=1)
    ps = [model.p_return_within(KEY, idle, 10.0) for idle in (0.0, 3.0, 10.0, 20.0)]
    assert all(p == pytest.approx(1 - math.exp(-1), abs=0.05) for p in ps)
    assert max(ps) - min(ps) < 0.05  # memoryless: idling changes nothing
    for idle in (0.0, 3.0, 10.0, 20.0):
        assert model.outlook(KEY, idle, DAY).expected_wait_s == pytest.approx(10.0, rel=0.08)


@pytest.mark.parametrize("idle_s", [0.0, 30.0, 300.0])
def test_lognormal_waits_answer_by_how_long_the_session_has_idled(idle_s: float) -> None:
    # 10,000 gaps, median 30 s, sigma 1.5: about 620 are left at idle 300 s, a binomial error
    # of 0.017 on P, so 0.04 (reached: 0.010 at idle 30 s, under 0.003 elsewhere).
    model = fed(lognormal(30.0, 1.5), 10_000, seed=2)
    truth = lognormal_survival(30.0, 1.5)
    assert model.p_return_within(KEY, idle_s, 60.0) == pytest.approx(
        p_within(truth, idle_s, 60.0), abs=0.04
    )


def test_lognormal_hazard_falls_as_the_session_idles() -> None:
    model = fed(lognormal(30.0, 1.5), 10_000, seed=2)
    ps = [model.p_return_within(KEY, idle, 60.0) for idle in (0.0, 30.0, 300.0, 600.0)]
    assert ps == sorted(ps, reverse=True)  # truth: 0.68, 0.54, 0.22, 0.14
    assert ps[0] - ps[2] > 0.4


def test_past_the_fast_mode_the_expected_wait_jumps_to_the_slow_mode() -> None:
    # 90% API calls (median 0.3 s) and 10% human approvals (median 120 s). 20,000 gaps give
    # about 2,000 slow ones: the conditional mean's sampling error is about 4%, so 10%
    # (reached: 1.8%).
    fast, slow = (0.3, 1.4), (120.0, 1.2)

    def draw(rng: random.Random) -> float:
        median, sigma = fast if rng.random() < 0.9 else slow
        return rng.lognormvariate(math.log(median), sigma)

    def truth(t: float) -> float:
        return 0.9 * lognormal_survival(*fast)(t) + 0.1 * lognormal_survival(*slow)(t)

    model = fed(draw, 20_000, seed=3)
    expected = {idle: model.outlook(KEY, idle, 3600.0).expected_wait_s for idle in (0.0, 5.0, 30.0)}
    for idle, value in expected.items():
        assert value == pytest.approx(remaining(truth, idle, 3600.0), rel=0.10)
    assert expected[30.0] > 5 * expected[0.0]  # truth: 243 s against 25 s
    assert model.p_return_within(KEY, 30.0, 5.0) < 0.05  # the fast ones are gone


def test_censored_waits_keep_the_estimate_unbiased_where_counting_them_as_gaps_does_not() -> None:
    # Gaps and censoring times both exponential with mean 100 s: half the sessions are
    # censored. Kaplan-Meier's error on P(T <= 100 s) with 4,000 sessions is about 0.013,
    # so 0.04 (reached: 0.026); 'censored = gap' sees min(T, C), P = 1 - e^-2: +0.23
    # (reached: +0.22).
    rng = random.Random(5)
    kaplan_meier, naive = WaitSurvival(half_life_obs=math.inf), WaitSurvival(half_life_obs=math.inf)
    for _ in range(4000):
        gap, censored_at = rng.expovariate(0.01), rng.expovariate(0.01)
        if gap <= censored_at:
            kaplan_meier.observe_gap(KEY, gap)
        else:
            kaplan_meier.observe_censored(KEY, censored_at)
        naive.observe_gap(KEY, min(gap, censored_at))
    truth = 1 - math.exp(-1)
    assert kaplan_meier.p_return_within(KEY, 0.0, 100.0) == pytest.approx(truth, abs=0.04)
    assert naive.p_return_within(KEY, 0.0, 100.0) - truth > 0.15


@pytest.mark.parametrize(
    ("n", "near_prior", "near_data"),
    [(0, 0.01, None), (1, 0.1, None), (2_000, None, 0.02)],
)
def test_a_class_answers_from_its_prior_until_its_data_outweighs_it(
    n: int, near_prior: float | None, near_data: float | None
) -> None:
    # api's prior says P(T <= 1 s) = 0.81; its data (median 30 s) says 0.002. With n gaps
    # against the prior's 10 the prior's share of the hazard is 10 / (n + 10): 1 gap moves
    # the answer at most 0.08 (reached: 0.067); 2,000 leave 0.005 of it (reached: 0.007).
    api = WaitKey("acme", "api")
    model = fed(lognormal(30.0, 1.2), n, seed=6, key=api)
    p = model.p_return_within(api, 0.0, 1.0)
    if near_prior is not None:
        assert p == pytest.approx(1 - PRIORS["api"].survival(1.0), abs=near_prior)
    if near_data is not None:
        assert p == pytest.approx(1 - lognormal_survival(30.0, 1.2)(1.0), abs=near_data)


def test_the_prior_hands_over_to_the_data_step_by_step() -> None:
    api = WaitKey("acme", "api")
    ps = [
        fed(lognormal(30.0, 1.2), n, seed=6, key=api).p_return_within(api, 0.0, 1.0)
        for n in (0, 1, 3, 10, 30, 300, 2000)
    ]
    assert ps == sorted(ps, reverse=True)  # reached: 0.80, 0.74, 0.65, 0.48, 0.31, 0.05, 0.01


@pytest.mark.parametrize(
    ("key", "prior", "t_s"),
    [
        (WaitKey("new", "human"), PRIORS["human"], 120.0),
        (WaitKey("new", "file"), PRIORS["file"], 0.05),
        (WaitKey("new", None), DEFAULT_PRIOR, 2.0),
        (WaitKey("new", "no-such-tool"), DEFAULT_PRIOR, 2.0),
        (WaitKey("new", "x" * (MAX_CLASS_LEN + 1)), DEFAULT_PRIOR, 2.0),
    ],
)
def test_an_unseen_key_answers_from_its_class_prior_else_the_default(
    key: WaitKey, prior: LogNormal, t_s: float
) -> None:
    # t_s is each prior's median: 0.5 up to the bins' linear interpolation (reached: 0.002).
    model = WaitSurvival(PRIORS)
    assert model.p_return_within(key, 0.0, t_s) == pytest.approx(0.5, abs=0.01)
    assert prior.survival(t_s) == pytest.approx(0.5)


def test_an_unknown_class_answers_from_the_tenant_wide_model() -> None:
    model = fed(lognormal(600.0, 0.5), 500, seed=7, key=WaitKey("acme", "human"))
    tenant_wide = model.p_return_within(WaitKey("acme", None), 0.0, 60.0)
    assert tenant_wide < 0.05  # the tenant's gaps are long; the default prior says 0.82
    for unknown in ("no-such-tool", "x" * (MAX_CLASS_LEN + 1), ""):
        assert model.p_return_within(WaitKey("acme", unknown), 0.0, 60.0) == tenant_wide


def test_a_new_class_without_a_prior_starts_from_the_tenant_wide_model() -> None:
    # The tenant's gaps are long (median 600 s); a new tool's first gap is too. Starting from
    # the default prior one gap would leave P(T <= 60 s) near its 0.82 (reached: 0.75); from
    # the tenant-wide model's hazards it stays near the tenant's (reached: 0.03).
    new_tool = WaitKey("acme", "new-tool")
    known_tenant = fed(lognormal(600.0, 0.5), 500, seed=7, key=WaitKey("acme", "human"))
    new_tenant = WaitSurvival(PRIORS)
    for model in (known_tenant, new_tenant):
        model.observe_gap(new_tool, 600.0)
        assert new_tool in model
    assert known_tenant.p_return_within(new_tool, 0.0, 60.0) < 0.1
    assert new_tenant.p_return_within(new_tool, 0.0, 60.0) > 0.5


def tools_and_unknown(person_too: bool = False) -> tuple[WaitSurvival, WaitSurvival, WaitSurvival]:
    """Tenant acme's waits: 300 on the tool grep (about 1 s) and 300 of no class (about
    10 min), interleaved (with `person_too`, 300 more on "person", about 10 min). Beside it,
    models fed the same gaps with no class: the grep gaps only, and all of them."""
    model, tools, everything = (WaitSurvival(PRIORS) for _ in range(3))
    rng = random.Random(21)
    for _ in range(300):
        short, long, person = rng.lognormvariate(0.0, 0.5), rng.lognormvariate(6.4, 0.5), 600.0
        model.observe_gap(WaitKey("acme", "grep"), short)
        model.observe_gap(WaitKey("acme", None), long)
        tools.observe_gap(WaitKey("acme", None), short)
        everything.observe_gap(WaitKey("acme", None), short)
        everything.observe_gap(WaitKey("acme", None), long)
        if person_too:
            model.observe_gap(WaitKey("acme", "person"), person)
            everything.observe_gap(WaitKey("acme", None), person)
    return model, tools, everything


def test_a_tool_not_seen_yet_answers_from_the_tenants_tool_pool() -> None:
    # The pool is exactly a model of the tool gaps alone; the tenant-wide model has the long
    # waits of no class too, and a person's reply (not seen yet, no prior) answers from it.
    model, tools, everything = tools_and_unknown()
    pool = tools.outlook(WaitKey("acme", None), 0.0, 60.0)
    tenant = everything.outlook(WaitKey("acme", None), 0.0, 60.0)
    assert pool.p_return > 0.95 and tenant.p_return < 0.6  # far apart: which one answers shows
    for new_tool in (WaitKey("acme", "sed"), WaitKey("acme", "sed", 2)):
        assert model.outlook(new_tool, 0.0, 60.0) == pool
    assert model.outlook(WaitKey("acme", "person"), 0.0, 60.0) == tenant
    assert model.outlook(WaitKey("acme", None), 0.0, 60.0) == tenant
    assert model.outlook(WaitKey("acme", "x" * (MAX_CLASS_LEN + 1)), 0.0, 60.0) == tenant


def test_waits_on_a_person_are_not_pooled_with_the_tools() -> None:
    model, tools, everything = tools_and_unknown(person_too=True)
    pool = tools.outlook(WaitKey("acme", None), 0.0, 60.0)
    assert model.outlook(WaitKey("acme", "sed"), 0.0, 60.0) == pool
    assert model.outlook(WaitKey("acme", None), 0.0, 60.0) == everything.outlook(
        WaitKey("acme", None), 0.0, 60.0
    )
    assert model.p_return_within(WaitKey("acme", "person"), 0.0, 60.0) < 0.1  # its own


def test_a_new_tool_starts_from_the_tool_pool_and_a_person_from_the_tenant() -> None:
    # One wait each, still going at 30 s, censored. Started from the pool's hazards (tools
    # back within seconds), the new tool keeps most of the pool's say at 60 s (reached:
    # 0.92; from the tenant's it would be near 0.5); the person, started from the tenant's
    # (half its waits are 10 min), keeps near the tenant's 0.51 (reached: 0.46).
    model, _, everything = tools_and_unknown()
    tenant = everything.p_return_within(WaitKey("acme", None), 0.0, 60.0)
    for new in ("sed", "person"):
        model.observe_censored(WaitKey("acme", new), 30.0)
    assert model.p_return_within(WaitKey("acme", "sed"), 0.0, 60.0) > 0.8
    assert model.p_return_within(WaitKey("acme", "person"), 0.0, 60.0) == pytest.approx(
        tenant, abs=0.1
    )


def depth_fed(seed: int, first_turn_returns: float, later_returns: float) -> WaitSurvival:
    """Sessions of tenant acme, class probe (no prior of its own): on their first turn a
    share comes back after about 10 s and the rest never does (censored at 30 min); from
    their second turn on, another share."""
    model = WaitSurvival(PRIORS, half_life_obs=math.inf)
    rng = random.Random(seed)
    for depth, share in ((1, first_turn_returns), (2, later_returns), (5, later_returns)):
        key = WaitKey("acme", "probe", depth_of(depth))
        for _ in range(400):
            if rng.random() < share:
                model.observe_gap(key, rng.lognormvariate(math.log(10.0), 0.3))
            else:
                model.observe_censored(key, 1800.0)
    return model


def test_a_depth_learns_how_likely_its_sessions_are_to_return() -> None:
    # 25 % of first turns and 65 % of later ones come back (the conversation trace's
    # shares): each depth answers its own share within a binomial error of 400 samples
    # (0.022, 3 sigma 0.065), and the depth-less key the mix of all three; the default
    # prior's pull adds up to +0.035 where 3 in 4 never return (reached: 0.05).
    model = depth_fed(seed=11, first_turn_returns=0.25, later_returns=0.65)
    p = {d: model.p_return_within(WaitKey("acme", "probe", d), 0.0, 1800.0) for d in (1, 2, 4)}
    assert p[1] == pytest.approx(0.25, abs=0.065)
    assert p[2] == pytest.approx(0.65, abs=0.065)
    assert p[4] == pytest.approx(0.65, abs=0.065)  # the 5th turn is kept at depth 4
    mixed = model.p_return_within(WaitKey("acme", "probe"), 0.0, 1800.0)
    assert mixed == pytest.approx((0.25 + 0.65 * 2) / 3, abs=0.065)


def test_an_unseen_depth_answers_from_its_key_at_any_depth() -> None:
    model = depth_fed(seed=12, first_turn_returns=0.25, later_returns=0.65)
    for key in (WaitKey("acme", "probe", 3), WaitKey("acme", "probe", 0)):
        assert model.p_return_within(key, 0.0, 60.0) == model.p_return_within(
            WaitKey("acme", "probe"), 0.0, 60.0
        )
    # The tenant-wide model learns by depth too, for turns without a class.
    first = model.p_return_within(WaitKey("acme", None, 1), 0.0, 1800.0)
    later = model.p_return_within(WaitKey("acme", None, 2), 0.0, 1800.0)
    assert first == pytest.approx(0.25, abs=0.065)
    assert later == pytest.approx(0.65, abs=0.065)


def test_a_new_depth_starts_from_its_key_at_any_depth() -> None:
    # 400 first turns that return after 10 s; then one 2nd turn that never returns. From
    # the depth-less key's hazards (weight 10) the 2nd depth still says about 10 / 11
    # (reached: 0.92); from the default prior it would say 0.75.
    model = WaitSurvival(PRIORS, half_life_obs=math.inf)
    for _ in range(400):
        model.observe_gap(WaitKey("acme", "probe", 1), 10.0)
    model.observe_censored(WaitKey("acme", "probe", 2), 1800.0)
    assert WaitKey("acme", "probe", 2) in model
    assert model.p_return_within(WaitKey("acme", "probe", 2), 0.0, 60.0) == pytest.approx(
        10 / 11, abs=0.02
    )


@pytest.mark.parametrize(("turns", "depth"), [(None, 0), (0, 0), (-3, 0), (1, 1), (4, 4), (9, 4)])
def test_turns_so_far_map_to_a_depth_of_at_most_four(turns: int | None, depth: int) -> None:
    assert depth_of(turns) == depth
    assert MAX_DEPTH == 4


@pytest.mark.parametrize("share", [0.25, 0.65])
def test_a_short_prior_does_not_pull_down_sessions_that_never_return(share: float) -> None:
    # The api prior ends nearly every wait within seconds; 400 sessions of which a share
    # comes back after about 10 s and the rest never does (censored at 30 min). A prior
    # whose sessions have all ended must not keep ending some in every later bin: the
    # estimate stays within the binomial error of 400 (3 sigma 0.065; reached: 0.01),
    # where ending weight x S per bin read 0.51 for 0.25.
    model = WaitSurvival(PRIORS, half_life_obs=math.inf)
    key = WaitKey("acme", "api")
    rng = random.Random(5)
    for _ in range(400):
        if rng.random() < share:
            model.observe_gap(key, rng.lognormvariate(math.log(10.0), 0.3))
        else:
            model.observe_censored(key, 1800.0)
    assert model.p_return_within(key, 0.0, 1800.0) == pytest.approx(share, abs=0.065)
    assert model.p_return_within(key, 0.0, 100.0) == pytest.approx(share, abs=0.065)


def test_forgetting_tracks_a_shift_in_the_waits() -> None:
    # 1,000 gaps of mean 1 s, then 600 of mean 100 s, forgotten at a half-life of 100
    # observations: 289 effective samples, a binomial error of 0.017, and a bias of about
    # +0.02 (1.5% of the weight is still the old gaps): 0.07 (reached: 0.050). Without
    # forgetting the old gaps hold most of the weight. Prior weight 1: the prior's pull is
    # not what this test measures.
    def answer(half_life_obs: float) -> float:
        model = WaitSurvival(half_life_obs=half_life_obs, prior_weight=1.0)
        rng = random.Random(8)
        for mean in [1.0] * 1000 + [100.0] * 600:
            model.observe_gap(KEY, rng.expovariate(1 / mean))
        return model.p_return_within(KEY, 0.0, 10.0)

    truth = 1 - math.exp(-0.1)
    assert answer(100.0) == pytest.approx(truth, abs=0.07)
    assert answer(math.inf) - truth > 0.5  # reached: 0.66 against 0.095


def hinted(noise: Callable[[random.Random, float], float], n: int, seed: int = 9) -> WaitSurvival:
    """Gaps of median 30 s, sigma 1.5; each with the hint `noise(rng, gap)`."""
    model = WaitSurvival(PRIORS)
    rng = random.Random(seed)
    for _ in range(n):
        gap = rng.lognormvariate(math.log(30.0), 1.5)
        model.observe_gap(KEY, gap, hint_s=noise(rng, gap))
    return model


def accurate(rng: random.Random, gap: float) -> float:
    """Half the real wait, give or take 10%: biased, but sharp."""
    return gap / 2 * math.exp(rng.gauss(0.0, 0.1))


def noise(rng: random.Random, gap: float) -> float:
    """A guess drawn from the same distribution as the gaps, blind to this one."""
    return rng.lognormvariate(math.log(30.0), 1.5)


@pytest.mark.parametrize("gap_s", [5.0, 30.0, 200.0])
def test_accurate_hints_earn_trust_and_sharper_answers(gap_s: float) -> None:
    # 400 hinted returns: the hint explains 99.6% of the log-variance and 216 samples weigh
    # in: trust 0.97. Mass within -20%..+25% of the real wait: with the hint at least 0.85
    # (reached: 0.95), without it the data's 0.04..0.11.
    model = hinted(accurate, 400)
    assert model.hint_trust(KEY) > 0.9

    def window(hint_s: float | None) -> float:
        near = model.p_return_within(KEY, 0.0, 1.25 * gap_s, hint_s)
        return near - model.p_return_within(KEY, 0.0, 0.8 * gap_s, hint_s)

    assert window(gap_s / 2) > 0.85  # the learned bias doubles the hint back
    assert window(None) < 0.2


def test_an_accurate_hint_centres_the_expected_wait_on_the_real_one() -> None:
    # The untrusted 3% keeps the data's mean (108 s) in the blend: 10% (reached: 0.4%).
    model = hinted(accurate, 400)
    assert model.outlook(KEY, 0.0, DAY, hint_s=100.0).expected_wait_s == pytest.approx(200, rel=0.1)
    assert model.outlook(KEY, 0.0, DAY).expected_wait_s < 150  # without it, the data: 108 s


def test_noise_hints_earn_no_trust_and_answers_fall_back_to_the_data() -> None:
    # A blind guess adds its own variance: log(gap / hint) spreads more than log(gap).
    model = hinted(noise, 400)
    assert model.hint_trust(KEY) < 0.05  # reached: 0
    for hint_s in (1.0, 30.0, 1000.0):
        with_hint = model.p_return_within(KEY, 0.0, 30.0, hint_s)
        assert with_hint == pytest.approx(model.p_return_within(KEY, 0.0, 30.0), abs=0.02)


def test_few_hints_earn_little_trust() -> None:
    # Trust is shrunk by n / (n + 5): two hinted returns earn at most 2/7.
    assert hinted(accurate, 0).hint_trust(KEY) == 0.0
    assert 0.0 < hinted(accurate, 2).hint_trust(KEY) < 0.3


def test_the_number_of_keys_is_capped_least_recently_used_first() -> None:
    model = WaitSurvival(max_keys=5)
    for i in range(6):  # each feeds ("t", "c<i>"), the tenant-wide ("t", None), the tool pool
        model.observe_gap(WaitKey("t", f"c{i}"), 1.0)
    assert len(model) == 5
    assert [WaitKey("t", f"c{i}") in model for i in range(6)] == [False] * 3 + [True] * 3
    assert WaitKey("t", None) in model
    dropped = model.p_return_within(WaitKey("t", "c0"), 0.0, 2.0)
    assert dropped == model.p_return_within(WaitKey("t", None), 0.0, 2.0)


def test_a_class_name_over_the_limit_is_treated_as_unknown() -> None:
    model = WaitSurvival()
    model.observe_gap(WaitKey("t", "x" * MAX_CLASS_LEN), 1.0)
    model.observe_gap(WaitKey("t", "x" * (MAX_CLASS_LEN + 1)), 1.0)
    assert WaitKey("t", "x" * MAX_CLASS_LEN) in model
    assert WaitKey("t", "x" * (MAX_CLASS_LEN + 1)) not in model
    assert len(model) == 3  # the kept class, the tenant's tool pool and its tenant-wide model


BAD = [math.nan, math.inf, -math.inf, -1.0]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("gap_s", lambda m, v: m.observe_gap(KEY, v)),
        ("hint_s", lambda m, v: m.observe_gap(KEY, 1.0, hint_s=v)),
        ("idle_s", lambda m, v: m.observe_censored(KEY, v)),
        ("idle_s", lambda m, v: m.p_return_within(KEY, v, 1.0)),
        ("t_s", lambda m, v: m.p_return_within(KEY, 0.0, v)),
        ("hint_s", lambda m, v: m.p_return_within(KEY, 0.0, 1.0, v)),
        ("idle_s", lambda m, v: m.outlook(KEY, v, 1.0)),
        ("horizon_s", lambda m, v: m.outlook(KEY, 0.0, v)),
        ("hint_s", lambda m, v: m.outlook(KEY, 0.0, 1.0, v)),
    ],
)
def test_a_bad_time_raises_naming_it(
    name: str, call: Callable[[WaitSurvival, float], object], value: float
) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds >= 0"):
        call(WaitSurvival(), value)


def test_times_outside_the_bins_are_clamped_to_them() -> None:
    model = WaitSurvival(prior_weight=0.01)
    for gap_s in (0.0, 1e-9, 1e12):
        model.observe_gap(KEY, gap_s, hint_s=0.0)
    # Two of three gaps clamped into the first bin, [1 ms, 1.33 ms).
    assert model.p_return_within(KEY, 0.0, EDGES[1]) == pytest.approx(2 / 3, abs=0.01)
    assert model.p_return_within(KEY, 2 * MAX_GAP_S, 1.0) == 0.0  # past the bins: not back
    assert model.outlook(KEY, 2 * MAX_GAP_S, 60.0) == (0.0, 60.0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prior_weight": 0.0}, "prior_weight"),
        ({"prior_weight": math.nan}, "prior_weight"),
        ({"half_life_obs": 0.0}, "half_life_obs"),
        ({"half_life_obs": math.nan}, "half_life_obs"),
        ({"max_keys": 0}, "max_keys"),
    ],
)
def test_bad_settings_raise(kw: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WaitSurvival(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("median_s", "p95_s"), [(0.3, 3.0), (120.0, 900.0), (5.0, 5.0)])
def test_a_lognormal_prior_keeps_its_median_p95_and_mean(median_s: float, p95_s: float) -> None:
    prior = LogNormal.from_median_p95(median_s, p95_s)
    assert prior.survival(median_s) == pytest.approx(0.5)
    assert prior.survival(p95_s) == pytest.approx(0.05 if p95_s > median_s else 0.5)
    assert prior.area(0.0, 1e9) == pytest.approx(median_s * math.exp(prior.sigma**2 / 2))
    assert prior.area(median_s, 3 * median_s) == pytest.approx(
        remaining(prior.survival, median_s, 2 * median_s) * 0.5, rel=1e-4
    )
