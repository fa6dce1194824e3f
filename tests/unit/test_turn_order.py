"""The order a worker takes its waiting turns in (`policy/routing/turn_order.py`): granted
priority first, then the shortest estimated prefill, as one vLLM priority value."""

from __future__ import annotations

from appliance.policy.routing.turn_order import PREFILL_RANKS, PREFILL_STEP_S, turn_priority


def test_a_shorter_prefill_goes_first_among_turns_of_one_granted_priority() -> None:
    short, long = turn_priority(0, 0.05), turn_priority(0, 6.0)
    assert short < long  # vLLM runs the lowest value first
    assert turn_priority(0, 0.0) == turn_priority(0, PREFILL_STEP_S * 0.99)  # one rank
    assert turn_priority(0, PREFILL_STEP_S * 1.01) == turn_priority(0, 0.0) + 1


def test_a_higher_granted_priority_outranks_any_prefill() -> None:
    assert turn_priority(1, 10**6) < turn_priority(0, 0.0)
    assert turn_priority(0, 10**6) < turn_priority(-1, 0.0)
    assert turn_priority(0, 10**6) == PREFILL_RANKS - 1  # the last rank, never the next one


def test_granted_priorities_stay_as_admission_sent_them_before() -> None:
    # The rank is under one step of PREFILL_RANKS, so dividing it out gives the negated grant.
    for granted in (-2, 0, 3):
        for prefill_s in (-1.0, 0.0, 0.37, 99.0, 1e9):
            assert turn_priority(granted, prefill_s) // PREFILL_RANKS == -granted


def test_the_value_is_the_negated_grant_times_the_ranks_plus_the_prefill_rank() -> None:
    # What the worker receives, written out: granted 2, a 0.35 s prefill (rank 3 of 0.1 s).
    assert turn_priority(2, 0.35) == -2 * 1000 + 3
    assert turn_priority(0, 99.95) == 999 and turn_priority(-1, 0.0) == 1000
