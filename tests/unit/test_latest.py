"""Pure tests of the decisions that never wait (popmesh.population.judge and its rules).

Closed-form reports: rank r reports objective ``10 * r`` unless a test says otherwise, so rank 0 is
the worst and the highest rank the best.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popmesh.core.errors import ConfigError
from popmesh.population import LatestRules, LatestState, Report, Verdict, init_latest, judge

OPEN = LatestRules(relative_gap=0.0, absolute_gap=0.0)  # any strictly better donor qualifies


def reports(objectives, steps=1000, iteration=10, **extra):
    """One report per rank; ``steps`` one number for all or one per rank."""
    per_rank = steps if isinstance(steps, (list, tuple)) else [steps] * len(objectives)
    return [Report(r, iteration, s, float(o), **extra) for r, (o, s) in enumerate(zip(objectives, per_rank))]


def verdict_of(rank, objectives, rules=OPEN, state=None, **kwargs) -> Verdict:
    state = init_latest(len(objectives)) if state is None else state
    return judge(rank, reports(objectives, **kwargs), state, rules)[0]


# ---------------------------------------------------------------- quantile fraction

def test_the_bottom_quarter_is_replaced_by_the_top_quarter():
    v = verdict_of(0, [0, 10, 20, 30])
    assert v.replace and v.donors == (3,) and v.objectives == {0: 0.0, 1: 10.0, 2: 20.0, 3: 30.0}
    assert "replaced" in v.reason and "4th of 4" in v.reason
    assert not verdict_of(1, [0, 10, 20, 30]).replace  # 3rd of 4: above the bottom one
    assert "above the bottom 1" in verdict_of(1, [0, 10, 20, 30]).reason


@pytest.mark.parametrize("n, fraction, k", [(2, 0.25, 1), (4, 0.25, 1), (5, 0.25, 2), (8, 0.25, 2), (10, 0.3, 3),
                                            (8, 0.5, 4), (3, 0.5, 1)])
def test_quantile_size_is_rays(n, fraction, k):
    """ceil(n * f), at most n // 2 (Ray Tune PBT's _quantiles), so bottom and top never overlap."""
    objectives = list(range(n))
    rules = LatestRules(quantile_fraction=fraction, relative_gap=0.0, absolute_gap=0.0)
    replaced = [r for r in range(n) if verdict_of(r, objectives, rules).replace]
    assert replaced == list(range(k))
    assert set(verdict_of(0, objectives, rules).donors) == set(range(n - k, n))


def test_ties_follow_the_selection_order():
    """Equal objectives: the higher rank is the worse, the lower the better donor."""
    assert [r for r in range(4) if verdict_of(r, [5, 5, 5, 5]).replace] == []  # no lead, nobody replaced
    rules = LatestRules(quantile_fraction=0.25, relative_gap=0.0, absolute_gap=0.0)
    assert verdict_of(3, [5, 9, 9, 5], rules).replace  # rank 3 is below rank 0 among the 5s
    assert not verdict_of(0, [5, 9, 9, 5], rules).replace
    assert verdict_of(3, [5, 9, 9, 5], rules).donors == (1,)  # the top one: rank 1 before rank 2


def test_max_donors_keeps_the_best():
    rules = LatestRules(quantile_fraction=0.5, relative_gap=0.0, absolute_gap=0.0, max_donors=1)
    assert verdict_of(0, [0, 10, 20, 30], rules).donors == (3,)
    assert verdict_of(0, [0, 10, 20, 30], LatestRules(quantile_fraction=0.5, relative_gap=0.0,
                                                      absolute_gap=0.0)).donors == (2, 3)


# ---------------------------------------------------------------- both gaps

@pytest.mark.parametrize("own, donor, replaced", [
    (90.0, 100.0, False),   # lead 10 is not > 0.1 * 100
    (89.0, 100.0, True),    # lead 11 passes both
    (-120.0, -100.0, True),  # negative objectives: lead 20 > 0.1 * |-100|
    (-105.0, -100.0, False),  # lead 5 < 10
])
def test_relative_gap_is_against_the_donors_magnitude(own, donor, replaced):
    rules = LatestRules(relative_gap=0.1, absolute_gap=0.0)
    assert verdict_of(0, [own, donor], rules).replace is replaced


def test_both_gaps_must_pass():
    rules = LatestRules(relative_gap=0.1, absolute_gap=5.0)
    assert not verdict_of(0, [0.0, 4.0], rules).replace  # passes the relative gap only
    assert not verdict_of(0, [900.0, 1000.0], rules).replace  # passes the absolute gap only (100 > 5, not > 100)
    assert verdict_of(0, [800.0, 1000.0], rules).replace  # 200 > 5 and 200 > 100
    v = verdict_of(0, [0.0, 4.0], rules)
    assert "leads by 4" in v.reason and "needs > 5" in v.reason


def test_default_gaps_are_sample_factorys():
    rules = LatestRules()
    assert (rules.relative_gap, rules.absolute_gap, rules.quantile_fraction) == (0.1, 1e-6, 0.25)


# ---------------------------------------------------------------- experience matching

def test_a_rank_is_compared_only_with_reports_at_equal_or_less_experience():
    """Rank 1 ran ahead (4,000 steps, objective 50); at 1,000 steps rank 0 compares with rank 1's
    report at 1,000 steps, where it was no better."""
    state = init_latest(2)
    _, state = judge(0, [Report(0, 1, 1000, 10.0), Report(1, 1, 1000, 10.0)], state, OPEN)
    v, state = judge(0, [Report(0, 1, 1000, 10.0), Report(1, 4, 4000, 50.0)], state, OPEN)
    assert not v.replace and v.objectives == {0: 10.0, 1: 10.0}
    unmatched = LatestRules(relative_gap=0.0, absolute_gap=0.0, match_experience=False)
    v2, _ = judge(0, [Report(0, 1, 1000, 10.0), Report(1, 4, 4000, 50.0)], state, unmatched)
    assert v2.replace and v2.objectives[1] == 50.0


def test_a_member_with_no_report_at_or_below_is_not_compared():
    v = verdict_of(0, [0.0, 50.0], steps=[1000, 4000])
    assert not v.replace and "no other member has a report at or below 1000 steps" in v.reason
    assert v.objectives == {0: 0.0}


def test_the_clock_can_be_iterations():
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, clock="iterations")
    state = init_latest(2)
    reps = [Report(0, 5, 1, 0.0), Report(1, 5, 999_999, 9.0)]  # steps forbid the match; iterations do not
    assert judge(0, reps, state, rules)[0].replace
    assert not judge(0, reps, state, OPEN)[0].replace


# ---------------------------------------------------------------- best within the interval

def test_interval_best_damps_a_dip():
    """Rank 0 scored 40 at 1,000 steps and dips to 5 at 2,000: with an interval of 1,000 steps it still
    counts 40, above rank 1's 30."""
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, interval=1000)
    state = init_latest(2)
    _, state = judge(0, [Report(0, 1, 1000, 40.0), Report(1, 1, 1000, 30.0)], state, rules)
    v, _ = judge(0, [Report(0, 2, 2000, 5.0), Report(1, 2, 2000, 30.0)], state, rules)
    assert not v.replace and v.objectives == {0: 40.0, 1: 30.0}
    last_only, _ = judge(0, [Report(0, 2, 2000, 5.0), Report(1, 2, 2000, 30.0)], state, OPEN)
    assert last_only.replace  # interval 0: the last value, 5
    too_short = LatestRules(relative_gap=0.0, absolute_gap=0.0, interval=999)
    assert judge(0, [Report(0, 2, 2000, 5.0), Report(1, 2, 2000, 30.0)], state, too_short)[0].replace


def test_history_is_bounded_and_ignores_stale_reports():
    rules = LatestRules(history=3)
    state = init_latest(1)
    for steps in (100, 200, 300, 400, 150):  # 150 comes after 400: stale, dropped
        _, state = judge(0, [Report(0, steps, steps, float(steps))], state, rules)
    assert state.history[0] == ((200.0, 200.0), (300.0, 300.0), (400.0, 400.0))
    _, state = judge(0, [Report(0, 400, 400, 7.0)], state, rules)  # the same clock: overwritten
    assert state.history[0][-1] == (400.0, 7.0)


def test_a_newer_generation_starts_afresh():
    state = init_latest(2)
    _, state = judge(0, [Report(0, 1, 100, 1.0), Report(1, 1, 500, 9.0)], state, OPEN)
    _, state = judge(0, [Report(0, 2, 200, 1.0), Report(1, 2, 600, 2.0, generation=1)], state, OPEN)
    assert state.history[1] == ((600.0, 2.0),) and state.generations == (0, 1)
    _, state = judge(0, [Report(0, 3, 300, 1.0), Report(1, 3, 700, 99.0, generation=0)], state, OPEN)
    assert state.history[1] == ((600.0, 2.0),)  # an older generation's report is stale


# ---------------------------------------------------------------- the cap, burn-in, exclusion

def test_a_replaced_rank_stands_in_the_others_comparisons_with_its_old_value_until_it_reports_again():
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, quantile_fraction=0.25)
    state = init_latest(4)
    v, state = judge(1, [Report(r, 1, 100, m) for r, m in enumerate([5.0, 1.0, 4.0, 3.0])], state, rules)
    assert v.replace and v.donors == (0,)
    v, state = judge(3, [Report(3, 2, 200, 3.0)], state, rules)
    assert not v.replace and v.objectives[1] == 1.0, "rank 1's old value still holds the bottom place"
    _, state = judge(1, [Report(1, 3, 300, 6.0)], state, rules)  # its new weights' first report
    assert state.history[1] == ((300.0, 6.0),), "the old weights' entries are gone once it reports"
    v, _ = judge(3, [Report(3, 4, 400, 3.0)], state, rules)
    assert v.replace and v.donors == (1,)


def test_cooldown_caps_how_often_a_rank_is_replaced():
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, cooldown=2000)
    state = init_latest(2)
    v, state = judge(0, reports([0, 10], steps=1000), state, rules)
    assert v.replace and state.last_replaced == (1000.0, None)
    v, state = judge(0, reports([0, 10], steps=2000), state, rules)
    assert not v.replace and "cooldown" in v.reason and "not again before 3000" in v.reason
    v, state = judge(0, reports([0, 10], steps=3000), state, rules)
    assert v.replace and state.last_replaced[0] == 3000.0


def test_a_replaced_rank_is_not_judged_on_its_old_weights():
    state = init_latest(2)
    v, state = judge(0, reports([0, 10]), state, OPEN)
    assert v.replace
    again, _ = judge(0, reports([0, 10]), state, OPEN)  # the same report: from before the replacement
    assert not again.replace and "no report of its own since its last replacement" in again.reason


def test_burn_in():
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, burn_in=5000)
    v = verdict_of(0, [0, 10], rules, steps=4999)
    assert not v.replace and "burn-in: 4999 of 5000 steps" in v.reason
    assert verdict_of(0, [0, 10], rules, steps=5000).replace


def test_excluded_ranks_are_neither_compared_nor_donors():
    state = init_latest(4)
    v, _ = judge(0, reports([0, 10, 20, 30]), state, OPEN, excluded={3})
    assert v.replace and v.donors == (2,) and 3 not in v.objectives
    v, _ = judge(0, reports([0, 10, 20, 30]), state, OPEN, excluded=[1, 2, 3])
    assert not v.replace and "no other member" in v.reason
    v, _ = judge(3, reports([0, 10, 20, 30]), state, OPEN, excluded=[3])
    assert not v.replace and "excluded" in v.reason


def test_a_donors_hparams_come_with_the_verdict():
    reps = [Report(0, 1, 10, 0.0, hparams={"lr": 0.1}), Report(1, 1, 10, 5.0, hparams={"lr": 0.01})]
    v, _ = judge(0, reps, init_latest(2), OPEN)
    assert v.donor_hparams == {1: {"lr": 0.01}}


def test_a_numpy_rank_is_a_rank():
    v, _ = judge(np.int64(0), reports([0, 10]), init_latest(2), OPEN)
    assert v.replace and v.rank == 0 and type(v.rank) is int


def test_the_state_is_returned_not_changed():
    state = init_latest(2)
    before = state
    _, after = judge(0, reports([0, 10]), state, OPEN)
    assert state is before and state == init_latest(2) and after != state
    assert isinstance(after, LatestState)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("objective", [math.nan, math.inf, -math.inf])
def test_a_non_finite_objective_names_the_rank(objective):
    with pytest.raises(ConfigError, match="rank 2 reported the objective"):
        Report(2, 1, 10, objective)


@pytest.mark.parametrize("options, match", [
    (dict(quantile_fraction=0.6), "every agent could be replaced"),
    (dict(quantile_fraction=0.0), r"\(0, 0.5\]"),
    (dict(relative_gap=-0.1), "relative_gap"),
    (dict(absolute_gap=-1.0), "absolute_gap"),
    (dict(absolute_gap=math.nan), "absolute_gap"),
    (dict(cooldown=-1), "cooldown"),
    (dict(burn_in=-1), "burn_in"),
    (dict(interval=-1), "interval"),
    (dict(clock="seconds"), "clock"),
    (dict(max_donors=0), "max_donors"),
    (dict(history=0), "history"),
    (dict(match_experience=1), "match_experience"),
])
def test_bad_rules(options, match):
    with pytest.raises(ConfigError, match=match):
        LatestRules(**options)


def test_unknown_options_name_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown options \['quantile'\]; valid: \['quantile_fraction'"):
        LatestRules.build({"quantile": 0.2})
    assert LatestRules.build({"quantile_fraction": 0.2}).quantile_fraction == 0.2


@pytest.mark.parametrize("call, match", [
    (lambda s: judge(0, [Report(1, 1, 1, 1.0)], s), "without its own report"),
    (lambda s: judge(0, [Report(0, 1, 1, 1.0), Report(0, 2, 2, 1.0)], s), "two reports"),
    (lambda s: judge(0, [Report(0, 1, 1, 1.0), Report(5, 2, 2, 1.0)], s), "outside the population"),
    (lambda s: judge(0, [Report(0, 1, 1, 1.0)], s, excluded=[9]), "excluded or reference names ranks"),
    (lambda s: judge(0, [Report(0, 1, 1, 1.0)], s, rules=0.25), "LatestRules"),
    (lambda s: judge(0, [(0, 1, 1, 1.0)], s), "Report values"),
    (lambda s: judge(0, [Report(0, 1, 1, 1.0)], (1, 2)), "LatestState"),
])
def test_bad_calls(call, match):
    with pytest.raises(ConfigError, match=match):
        call(init_latest(2))


@pytest.mark.parametrize("field, value", [("steps", -1), ("iteration", 1.5), ("generation", -2), ("rank", True)])
def test_bad_report_fields(field, value):
    fields = dict(rank=1, iteration=1, steps=1, objective=0.0)
    fields[field] = value
    with pytest.raises(ConfigError, match=field if field != "rank" else "Report.rank"):
        Report(**fields)


# ---------------------------------------------------------------- property

finite = st.floats(-1e6, 1e6, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(objectives=st.lists(finite, min_size=2, max_size=12), rel=st.floats(0, 2), absolute=st.floats(0, 100),
       fraction=st.floats(0.01, 0.5), data=st.data())
def test_never_replaced_by_a_donor_it_does_not_trail_by_both_gaps(objectives, rel, absolute, fraction, data):
    """With the last values compared, a donor leads the replaced rank's reported objective by more
    than both gaps, and lies in the top fraction of the reports."""
    rank = data.draw(st.integers(0, len(objectives) - 1))
    rules = LatestRules(quantile_fraction=fraction, relative_gap=rel, absolute_gap=absolute, match_experience=False)
    v, _ = judge(rank, reports(objectives), init_latest(len(objectives)), rules)
    if v.replace:
        own = objectives[rank]
        better = sorted(range(len(objectives)), key=lambda r: (-objectives[r], r))
        assert rank not in v.donors and v.donors
        for d in v.donors:
            lead = objectives[d] - own
            assert lead > absolute and lead > rel * abs(objectives[d])
            assert better.index(d) < better.index(rank)
    else:
        assert v.donors == ()


@settings(max_examples=200, deadline=None)
@given(rounds=st.lists(st.lists(st.tuples(st.integers(0, 5_000), finite), min_size=3, max_size=3),
                       min_size=1, max_size=6),
       interval=st.sampled_from([0, 500, 5_000]), data=st.data())
def test_every_donor_leads_by_both_gaps_under_every_rule(rounds, interval, data):
    """Over several rounds of reports, with matching and interval best, every donor's judged
    objective leads the judged rank's by more than both gaps."""
    rules = LatestRules(relative_gap=0.05, absolute_gap=1.0, interval=interval, quantile_fraction=0.34)
    state = init_latest(3)
    steps = [0, 0, 0]
    for round_ in rounds:
        reps = []
        for r, (more, objective) in enumerate(round_):
            steps[r] += more
            reps.append(Report(r, 0, steps[r], objective))
        v, state = judge(data.draw(st.integers(0, 2)), reps, state, rules)
        for d in v.donors:
            lead = v.objectives[d] - v.objectives[v.rank]
            assert lead > rules.absolute_gap and lead > rules.relative_gap * abs(v.objectives[d])


def test_the_state_goes_through_json_for_a_checkpoint():
    import json

    from popmesh.population.decisions.latest import latest_from_json, latest_to_json

    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, cooldown=2000)
    v, state = judge(0, reports([0, 10], steps=1000), init_latest(2), rules)
    assert v.replace
    back = latest_from_json(json.loads(json.dumps(latest_to_json(state))), 2)
    assert back.history == state.history and back.last_replaced == state.last_replaced and back.generations == (0, 0)
    again, _ = judge(0, reports([0, 10], steps=2000), back, rules)
    assert "cooldown" in again.reason, "the cap holds across a resume"
    with pytest.raises(ConfigError, match="holds 2 members, this population has 3"):
        latest_from_json(latest_to_json(state), 3)


def test_only_members_that_can_donate_do():
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, quantile_fraction=0.5)
    verdict = judge(0, reports([0, 10, 20, 30]), init_latest(4), rules, donors_from=(0, 1, 2))[0]
    assert verdict.replace and verdict.donors == (2,) and verdict.objectives[3] == 30.0  # 3 ranks, never donates
    verdict = judge(0, reports([0, 10, 20, 30]), init_latest(4), rules, donors_from=(0, 1))[0]
    assert not verdict.replace and "no top-2 member can donate yet" in verdict.reason
