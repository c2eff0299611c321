"""Synchronous population policies on a real world: rank r's weights are r + 1, metrics hand-made.

Run at 1 rank (identity) and 2, 3 and 4 ranks on torch/gloo, 3 on MPI; a check that needs more ranks
than a world has skips itself there. Closed forms: with metrics where
rank 0 is the worst, ``ratio=0.25`` replaces rank 0 alone by the mean of the others.
"""

import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import ConfigError
from popmesh.population import (
    AverageAll,
    DonorRule,
    Explore,
    OneSidedAveraging,
    ReplacementRule,
    SelectiveAveraging,
    decide,
    rank_weights,
)
from workers.population_common import (
    adam_for,
    assert_all,
    buffers_value,
    exp_avg_of,
    make_agent,
    mean,
    values,
)
from worldlib import check, main, need_ranks, skip

WORST_FIRST = {1: [1.0], 2: [1.0, 2.0], 3: [1.0, 3.0, 2.0], 4: [1.0, 4.0, 2.0, 3.0]}
QUARTER = ReplacementRule(ratio=0.25)


def others_mean(n, replaced=(0,)):
    return mean([r + 1 for r in range(n) if r not in replaced])


def run(policy, w, metrics, model=None, optimizer=None, iteration=0, group=None):
    model = make_agent(w.rank + 1) if model is None else model
    return policy(iteration, model, optimizer, metrics[w.rank], group=group)


@check
def average_all_divides_by_group_size(w):
    model, _opt, info = run(AverageAll(every=5), w, WORST_FIRST[w.size])
    assert info.averaged and info.acted and not info.replaced
    assert_all(model, (w.size + 1) / 2, what="average")
    assert np.allclose(buffers_value(model), w.rank + 1), "buffers are left alone by default"
    model, _, info = run(AverageAll(every=5, include_buffers=True), w, WORST_FIRST[w.size])
    assert np.allclose(buffers_value(model), (w.size + 1) / 2)
    model, _, info = run(AverageAll(every=5), w, WORST_FIRST[w.size], iteration=7)
    assert not info.acted and values(model)[0] == w.rank + 1, "off-cadence calls change nothing"


@check
def rank0_replaced_by_mean_of_others(w):
    n = w.size
    model, _, info = run(SelectiveAveraging(every=10, rule=QUARTER), w, WORST_FIRST[n])
    if n == 1:
        assert not info.replaced and info.summary == "a group of one"
        assert_all(model, 1.0)
        return
    assert info.metrics == {r: WORST_FIRST[n][r] for r in range(n)}
    if w.rank == 0:
        assert info.replaced and info.donors == tuple(range(1, n)), info
        assert np.allclose(info.weights, [1 / (n - 1)] * (n - 1))
        assert_all(model, others_mean(n), what="replaced rank 0")
    else:
        assert not info.replaced
        assert_all(model, w.rank + 1, what="donors keep their weights")


@check
def rank0_donates_best_only(w):
    n = w.size
    need_ranks(w, 2)
    metrics = [float(n - r) for r in range(n)]  # rank 0 best, last rank worst
    policy = SelectiveAveraging(every=1, rule=QUARTER, strategy="best_only")
    model, _, info = run(policy, w, metrics, iteration=3)
    expected = 1.0 if w.rank == n - 1 else w.rank + 1
    assert_all(model, expected, what="best_only from rank 0")
    assert info.replaced == (w.rank == n - 1) and (not info.replaced or info.donors == (0,))


@check
def weighted_mean_favours_better_donors(w):
    n = w.size
    need_ranks(w, 3)
    metrics = [float(r + 1) for r in range(n)]  # rank 0 worst, weights grow with the rank
    model, _, info = run(SelectiveAveraging(every=1, rule=QUARTER, strategy="weighted_mean"), w, metrics)
    weights = rank_weights(metrics[1:])
    expected = sum(wt * (r + 2) for r, wt in enumerate(weights))
    assert_all(model, expected if w.rank == 0 else w.rank + 1, what="weighted_mean")
    if w.rank == 0:
        assert list(info.weights) == sorted(info.weights) and info.weights[-1] > info.weights[0]


@check
def reset_weights_uses_the_builder(w):
    need_ranks(w, 2)
    policy = SelectiveAveraging(every=1, rule=QUARTER, strategy="reset_weights",
                                model_builder=lambda: make_agent(100.0))
    model, _, info = run(policy, w, WORST_FIRST[w.size])
    assert_all(model, 100.0 if w.rank == 0 else w.rank + 1, what="reset_weights")
    assert info.donors == () and info.replaced == (w.rank == 0)


@check
def nan_metric_is_replaced_and_never_donates(w):
    n = w.size
    need_ranks(w, 3)
    metrics = [float(r + 1) for r in range(n)]
    metrics[1] = math.nan
    model, _, info = run(SelectiveAveraging(every=1, rule=QUARTER), w, metrics)
    expected = others_mean(n, replaced=(1,)) if w.rank == 1 else w.rank + 1
    assert_all(model, expected, what="NaN rank")
    if w.rank == 1:
        assert 1 not in info.donors and info.replaced
    if n < 4:
        return  # the rest needs two ranks left to donate
    metrics[0] = math.inf  # +inf is invalid too: with half replaced, 0 and 1 go, the rest donate
    model, _, info = run(SelectiveAveraging(every=1, rule=ReplacementRule(ratio=0.5)), w, metrics)
    if w.rank in (0, 1):
        assert_all(model, others_mean(n, replaced=(0, 1)), what="inf and NaN ranks")
        assert set(info.donors) == set(range(2, n))


@check
def momentum_keeps_part_of_own_weights(w):
    n = w.size
    need_ranks(w, 2)
    model, _, _ = run(SelectiveAveraging(every=1, rule=QUARTER, momentum=0.25), w, WORST_FIRST[n])
    expected = 0.25 * 1.0 + 0.75 * others_mean(n) if w.rank == 0 else w.rank + 1
    assert_all(model, expected, tol=1e-3 if w.rank == 0 else 1e-6, what="momentum")


@check
def random_donors_follow_the_shared_seed(w):
    n = w.size
    need_ranks(w, 4)
    metrics = [float(r + 1) for r in range(n)]
    rule, donors = ReplacementRule(ratio=0.5), DonorRule("random", k=1)
    policy = SelectiveAveraging(every=1, rule=rule, donor_rule=donors, seed=7)
    model, _, info = run(policy, w, metrics, iteration=4)
    expected = decide(metrics, rule, donors, iteration=4, rng=np.random.default_rng([7, 4]))
    if w.rank in expected.replaced:
        (d,) = expected.donors[w.rank]
        assert info.donors == (d,)
        assert_all(model, d + 1, what="random donor")
    else:
        assert_all(model, w.rank + 1)


@check
def optimizer_state_policies(w):
    n = w.size
    need_ranks(w, 2)
    best = int(np.argmax(WORST_FIRST[n]))
    for policy_name, expected_rank0 in (("reset", None), ("keep", 0.1 * 1), ("copy", 0.1 * (best + 1))):
        model = make_agent(w.rank + 1)
        opt = adam_for(model, grad=w.rank + 1)  # exp_avg = 0.1 * (r + 1)
        _, new_opt, info = run(SelectiveAveraging(every=1, rule=QUARTER, optimizer_policy=policy_name), w,
                               WORST_FIRST[n], model=model, optimizer=opt)
        assert new_opt is opt
        got = exp_avg_of(opt)
        if w.rank == 0:
            assert (got is None) if expected_rank0 is None else math.isclose(got, expected_rank0, rel_tol=1e-5), \
                (policy_name, got)
            assert info.optimizer == {"reset": "reset", "keep": "keep", "copy": f"copied from {best}"}[policy_name]
            if policy_name == "copy":
                other = opt.state_dict()["state"][0]
                assert int(other["step"]) == 1 and float(other["exp_avg_sq"].reshape(-1)[0]) > 0
                assert_all(model, others_mean(n))
        else:
            assert math.isclose(got, 0.1 * (w.rank + 1), rel_tol=1e-5), "non-replaced optimizers untouched"


@check
def optimizer_builder_gives_a_new_optimizer(w):
    need_ranks(w, 2)
    model = make_agent(w.rank + 1)
    opt = adam_for(model)
    policy = SelectiveAveraging(every=1, rule=QUARTER,
                                optimizer_builder=lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    model, new_opt, info = run(policy, w, WORST_FIRST[w.size], model=model, optimizer=opt)
    if w.rank == 0:
        assert isinstance(new_opt, torch.optim.SGD) and info.optimizer == "rebuilt"
        assert new_opt.param_groups[0]["params"][0] is next(model.parameters())
    else:
        assert new_opt is opt


@check
def explore_perturbs_the_learning_rate(w):
    need_ranks(w, 2)
    model = make_agent(w.rank + 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    policy = SelectiveAveraging(every=1, rule=QUARTER, explore=Explore(resample_prob=0.0), seed=3)
    _, opt, info = run(policy, w, WORST_FIRST[w.size], model=model, optimizer=opt)
    lr = opt.param_groups[0]["lr"]
    if w.rank == 0:
        assert lr in (0.8, 1.2) and info.hparams == {"lr": [1.0, lr]}
    else:
        assert lr == 1.0 and info.hparams == {}


@check
def sub_group_with_an_idle_rank(w):
    n = w.size
    need_ranks(w, 3)
    members = list(range(n - 1))
    group = w.new_group(members)  # every rank forms the group; the idle rank then calls nothing
    if w.rank == n - 1:
        return
    model, _, info = run(AverageAll(every=1), w, WORST_FIRST[n], group=group)
    assert_all(model, n / 2, what="group average divides by the group size")
    metrics = [1.0] + [float(r + 1) for r in range(1, n - 1)]
    model, _, info = run(SelectiveAveraging(every=1, rule=QUARTER), w, metrics, group=group)
    assert set(info.metrics) == set(members)
    expected = others_mean(n - 1) if w.rank == 0 else w.rank + 1
    assert_all(model, expected, what="selective over the sub-group")


@check
def layout_mismatch_is_reported_on_every_rank(w):
    need_ranks(w, 2)
    model = make_agent(1.0) if w.rank != 1 else torch.nn.Linear(2, 2)
    try:
        SelectiveAveraging(every=1, rule=QUARTER)(0, model, None, 1.0)
    except ConfigError as e:
        assert "model layouts differ" in str(e) and "rank 1" in str(e), str(e)
    else:
        raise AssertionError("different architectures must be refused")


@check
def events_are_logged_as_jsonl(w):
    n = w.size
    need_ranks(w, 2)
    path = os.path.join(os.environ["POPMESH_TEST_OUT"], "events.jsonl")
    run(SelectiveAveraging(every=1, rule=QUARTER, events_path=path), w, WORST_FIRST[n], iteration=2)
    popmesh.barrier()
    if w.rank == 0:
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        assert len(lines) == 1, lines
        event = lines[0]
        assert event["rank"] == 0 and event["iteration"] == 2 and event["donors"] == list(range(1, n))
        assert event["metrics"] == {str(r): m for r, m in enumerate(WORST_FIRST[n])}
        assert event["optimizer"] == "reset" and event["strategy"] == "mean"


@check
def metric_is_required_on_decision_points(w):
    try:
        SelectiveAveraging(every=1)(0, make_agent(1.0), None, None)
    except ConfigError as e:
        assert "local_metric" in str(e)
    else:
        raise AssertionError("a decision point without a metric must be refused")


@check
def one_sided_needs_the_mpi_engine(w):
    policy = OneSidedAveraging(every=1, rule=QUARTER)
    model = make_agent(w.rank + 1)
    if w.engine_name == "mpi":
        skip("the MPI engine runs OneSidedAveraging (test_population_one_sided)")
    if w.size == 1:  # a world of one is the identity on every engine
        out, _, info = policy(0, model, None, 1.0)
        assert out is model and not info.replaced
        return
    try:
        policy(0, model, None, 1.0)
    except ConfigError as e:
        assert "mpi engine" in str(e) and "AsyncSelectiveAveraging" in str(e), str(e)
    else:
        raise AssertionError(f"OneSidedAveraging on {w.engine_name} must be refused")


if __name__ == "__main__":
    main()
