"""The asynchronous coordinator's deciders, without processes: each report judged as it arrives
(LatestBook, LatestDecider), one decision in flight per replaced rank, reports of replaced weights
told apart by generation; the complete protocol behind the same Protocol; the policy's options."""

import json
import math

import pytest

from popmesh import ConfigError
from popmesh.population import AsyncSelectiveAveraging, Decision, DonorRule, LatestRules, ReplacementRule, Verdict
from popmesh.population.decisions.latest import verdict_decision
from popmesh.population.decisions.options import SelectiveOptions
from popmesh.population.mechanisms.asynchronous.deciders import CompleteDecider, LatestBook, LatestDecider
from popmesh.population.mechanisms.asynchronous.protocol import ACK, BYE, METRIC, Up

EASY = LatestRules(relative_gap=0.0, absolute_gap=0.0)
GAP = LatestRules(relative_gap=0.3, absolute_gap=0.0)  # 4.0 does not lead 5.0's rank by enough: only far ones go


def report(iteration, metric, *, steps=None, generation=0, acked=-1, fingerprint=7):
    return Up(METRIC, iteration, float(metric), fingerprint, acked, iteration if steps is None else steps, generation)


def test_a_rank_is_judged_when_it_reports_against_the_others_latest_without_waiting():
    book = LatestBook(4, GAP)
    assert book.record(1, report(0, 4.0)) is not None  # judged alone: nothing to compare with
    assert not book.record(1, report(0, 4.0)).replace
    book.record(2, report(0, 3.0))
    verdict = book.record(0, report(0, 1.0))  # rank 3 never reported: nobody waits for it
    assert verdict.replace and verdict.donors == (1,) and set(verdict.objectives) == {0, 1, 2}
    assert book.in_flight == {0: (0, 1)} and book.judged == 4


def test_members_not_heard_from_can_count_below_the_judged_rank():
    book = LatestBook(4, LatestRules(relative_gap=0.3, absolute_gap=0.0, count_absent=True))
    for r, m in ((1, 4.0), (2, 3.0)):
        book.record(r, report(0, m))
    verdict = book.record(0, report(0, 1.0))  # rank 3 never reported: it counts below rank 0, 3rd of 4
    assert not verdict.replace and "1 member(s) not compared yet count below it" in verdict.reason
    book.record(3, report(0, 2.0))  # nobody waited for rank 3: its first report is simply there next time
    verdict = book.record(0, report(1, 1.0))
    assert verdict.replace and verdict.donors == (1,) and set(verdict.objectives) == {0, 1, 2, 3}
    with pytest.raises(ConfigError, match="count_absent must be True or False"):
        LatestRules(count_absent=1)


def test_one_decision_in_flight_per_replaced_rank_not_per_group():
    book = LatestBook(4, GAP)
    for r, m in ((1, 5.0), (2, 4.0)):
        book.record(r, report(10, m))
    assert book.record(0, report(10, 1.0)).replace
    # rank 0 reports its old weights again before applying: neither judged nor compared
    assert book.record(0, report(12, 1.0)) is None and book.in_flight == {0: (10, 1)}
    verdict = book.record(3, report(12, 0.5))  # another rank is decided meanwhile
    assert verdict.replace and verdict.donors == (1,) and verdict.objectives[0] == 1.0, "its old value stands in"
    assert book.in_flight == {0: (10, 1), 3: (12, 1)}
    assert book.missing_acks() == [0, 3]


def test_an_acknowledgement_or_a_report_of_the_new_generation_ends_the_flight():
    book = LatestBook(3, GAP)
    book.record(1, report(0, 5.0))
    book.record(2, report(0, 4.0))
    assert book.record(0, report(0, 1.0)).replace
    book.record(0, Up(ACK, 0, math.nan, 0, 0, -1, 0))
    assert book.in_flight == {}
    assert book.record(0, report(2, 1.0)) is None, "still its old weights (generation 0)"
    assert book.record(0, report(4, 1.0, generation=1)) is not None, "its new weights are judged"
    book = LatestBook(3, GAP)
    book.record(1, report(0, 5.0))
    book.record(2, report(0, 4.0))
    book.record(0, report(0, 1.0))
    verdict = book.record(0, report(2, 1.0, generation=1))  # applied, the ACK not yet in (it may follow)
    assert verdict is not None and verdict.replace and book.in_flight == {0: (2, 2)}


def test_the_history_keeps_every_judged_report_for_experience_matching():
    rules = LatestRules(relative_gap=0.0, absolute_gap=0.0, interval=0)
    book = LatestBook(2, rules)
    book.record(1, report(0, 1.0, steps=0))
    book.record(1, report(2, 9.0, steps=200))  # rank 1 ran ahead and got better
    verdict = book.record(0, report(0, 2.0, steps=100))  # compared with rank 1 at <= 100 steps: 1.0
    assert not verdict.replace and verdict.objectives == {0: 2.0, 1: 1.0}
    assert [e[0] for e in book.state.history[1]] == [0.0, 200.0]


def test_bye_and_fin_and_layouts():
    book = LatestBook(2, EASY)
    book.record(0, report(0, 1.0))
    with pytest.raises(ConfigError, match="layouts differ"):
        book.record(1, report(0, 2.0, fingerprint=8))
    book = LatestBook(2, EASY)
    book.record(1, report(0, 5.0))
    book.record(0, report(0, 1.0))
    book.record(1, Up(BYE, -1, math.nan, 0, -1, -1, 0))
    book.record(0, Up(BYE, -1, math.nan, 0, -1, -1, 0))
    assert not book.finished(), "rank 0's replacement is in flight"
    book.record(0, Up(ACK, 0, math.nan, 0, 0, -1, 0))
    assert book.finished()


def test_latest_decider_sends_one_rank_its_plan_and_the_donors_whom_to_stream_to():
    options = SelectiveOptions(5, strategy="weighted_mean", optimizer_policy="copy")
    decider = LatestDecider(4, options, LatestRules(quantile_fraction=0.5, relative_gap=0.5, absolute_gap=0.0))
    for r, (it, m) in {1: (40, 4.0), 2: (40, 3.0), 3: (10, 2.0)}.items():
        decider.record(r, report(it, m), now=0.0)
    assert decider.ready() == [], "3.0 does not lead 4.0 by half; rank 3 (10 steps) has nobody at or below it"
    decider.record(0, report(40, 1.0), now=0.0)
    (dispatch,) = decider.ready()
    assert dispatch.iteration == 40 and dispatch.replaced == (0,)
    assert sorted(dispatch.messages) == [0, 1, 2]
    mine = json.loads(json.dumps(dispatch.messages[0]))
    part = Decision.from_dict(mine["decision"])
    assert part.donors[0] == (1, 2) and part.copy_optimizer_from[0] == 1 and part.weights[0][0] > part.weights[0][1]
    assert mine["iterations"] == [40, 40, 40, 10] and mine["metrics"] == [1.0, 4.0, 3.0, 2.0]
    assert dispatch.messages[1]["recipients"] == [0] and "iterations" not in dispatch.messages[1]
    assert decider.stalled(1e9, 1.0) is None
    assert decider.state_dict()["latest"]["last_replaced"] == [40.0, None, None, None]


def test_complete_decider_waits_for_every_rank_as_before():
    decider = CompleteDecider(3, SelectiveOptions(5, rule=ReplacementRule(ratio=0.25)))
    decider.record(0, report(0, 1.0), now=0.0)
    decider.record(1, report(0, 2.0), now=0.0)
    assert decider.ready() == []
    assert decider.stalled(11.0, 10.0) == (0, [2])
    decider.record(2, report(0, 3.0), now=0.0)
    (dispatch,) = decider.ready()
    assert dispatch.replaced == (0,) and dispatch.messages[0]["iterations"] == [0, 0, 0]
    assert "selection" in decider.state_dict()


@pytest.mark.parametrize("strategy, donors, weights", [
    ("mean", (1, 2), (0.5, 0.5)), ("best_only", (1,), (1.0,)), ("reset_weights", (), ()),
])
def test_verdict_decision_weights_donors_by_strategy(strategy, donors, weights):
    verdict = Verdict(0, True, (1, 2), "replaced", {0: 1.0, 1: 5.0, 2: 4.0})
    d = verdict_decision(verdict, 4, strategy, iteration=8)
    assert d.replaced == (0,) and d.donors[0] == donors and d.weights[0] == weights and d.iteration == 8
    assert d.summary_in([10, 11, 12, 13]).startswith("replace 1 of 4 agents [10]")
    with pytest.raises(ConfigError, match="replaces nobody"):
        verdict_decision(Verdict(0, False, (), "kept"), 4)


# ---- the policy's options, checked at construction ------------------------------------------------
def test_latest_is_the_default_and_its_rules_follow_rule_and_donor_rule():
    policy = AsyncSelectiveAveraging(5, rule=ReplacementRule(ratio=0.5), donor_rule=DonorRule("best_k", 2))
    assert policy.decide == "latest" and policy.latest.quantile_fraction == 0.5 and policy.latest.max_donors == 2
    policy = AsyncSelectiveAveraging(5, latest={"relative_gap": 0.2, "interval": 50, "cooldown": 100,
                                                "burn_in": 20, "match_experience": False})
    assert (policy.latest.relative_gap, policy.latest.interval, policy.latest.quantile_fraction) == (0.2, 50, 0.25)
    assert AsyncSelectiveAveraging(5, decide="complete").latest is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(latest={"relative_gap": -1}), "relative_gap"),
    (dict(latest={"burn_in": math.nan}), "burn_in"),
    (dict(latest={"gaps": 1}), "unknown options"),
    (dict(latest=LatestRules(quantile_fraction=0.5), rule=ReplacementRule(ratio=0.25)), "quantile_fraction"),
    (dict(rule=ReplacementRule(ratio=0.75)), "rule.ratio"),
    (dict(rule=ReplacementRule(threshold=1.0)), "rule= may"),
    (dict(donor_rule=DonorRule("random", 2)), "random"),
    (dict(decide="newest"), "decide="),
])
def test_bad_latest_options_are_config_errors_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AsyncSelectiveAveraging(5, **kwargs)


def test_steps_must_be_a_count():
    policy = AsyncSelectiveAveraging(5)
    with pytest.raises(ConfigError, match="steps"):
        policy(1, None, None, None, steps=-3)


def test_the_reproducible_decider_decides_a_round_the_same_whatever_order_its_reports_arrive_in():
    from itertools import permutations

    from popmesh.population.mechanisms.asynchronous.deciders import ReproducibleDecider

    options = SelectiveOptions(10, rule=ReplacementRule(ratio=0.25))
    rounds = {0: [5.0, 1.0, 4.0, 3.0], 10: [5.0, 6.0, 0.5, 3.0]}
    outcomes = set()
    for order in permutations(range(4)):
        decider = ReproducibleDecider(4, options, LatestRules(relative_gap=0.0, absolute_gap=0.0))
        sent = []
        for t, metrics in rounds.items():
            for r in order:
                generation = 1 if t == 10 and r == 1 else 0  # rank 1 reports the weights round 0 gave it
                decider.record(r, report(t, metrics[r], generation=generation), 0.0)
                out = decider.ready()
                assert not out or r == order[-1], "a round is decided once it is complete"
                sent += [(d.iteration, d.replaced, json.dumps(d.messages, sort_keys=True)) for d in out]
        outcomes.add(tuple(sent))
    (sent,) = outcomes
    assert [(it, replaced) for it, replaced, _ in sent] == [(0, (1,)), (0, ()), (10, (2,)), (10, ())]


def test_a_round_waits_for_every_member_and_names_the_missing_ones():
    from popmesh.population.mechanisms.asynchronous.deciders import ReproducibleDecider

    decider = ReproducibleDecider(3, SelectiveOptions(10), EASY)
    decider.record(0, report(0, 1.0), 0.0)
    decider.record(1, report(0, 2.0), 1.0)
    assert decider.ready() == [] and decider.stalled(5.0, 10.0) is None
    assert decider.stalled(11.0, 10.0) == (0, [2])
    decider.record(2, Up(BYE, -1, math.nan, 0, -1, -1, 0), 12.0)
    assert [d.iteration for d in decider.ready()][-1] == 0, "a member that said BYE is not waited for"


def test_after_a_resume_a_member_known_from_the_state_alone_compares_but_never_donates():
    """A resumed coordinator's state holds every member's entries, but a member that has not reported
    since has no weights to stream nor values to hand on (the demo's MPI job restarted whole failed so)."""
    before = LatestDecider(4, SelectiveOptions.build(10, {}, "test"), EASY)
    for r, m in ((1, 2.0), (2, 3.0), (3, 9.0)):
        before.record(r, report(0, m), 0.0)
    resumed = LatestDecider(4, SelectiveOptions.build(10, {}, "test"), LatestRules(relative_gap=0.0, absolute_gap=0.0,
                                                                                     quantile_fraction=0.5))
    resumed.load_state_dict(json.loads(json.dumps(before.state_dict())))
    resumed.record(2, report(1, 3.0), 0.0)
    verdict = resumed.book.record(0, report(1, 1.0))
    assert verdict.replace and verdict.donors == (2,), verdict  # 3 leads, from the state: it compares, 2 donates
    assert verdict.objectives[3] == 9.0
    alone = LatestDecider(4, SelectiveOptions.build(10, {}, "test"), EASY)
    alone.load_state_dict(json.loads(json.dumps(before.state_dict())))
    verdict = alone.book.record(0, report(1, 1.0))
    assert not verdict.replace and "no top-1 member can donate yet" in verdict.reason, verdict
