"""popmesh.compat.spawn_policy on real worlds of 1, 2 and 3 ranks (torch or MPI engine); rank r's weights
are r + 1 and rank 0 is the worst agent."""

import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
import popmesh.compat.spawn_policy as sp
from popmesh import ConfigError
from popmesh.population import ReplacementRule, decide
from worldlib import check, main, need_ranks

torch.set_num_threads(1)
METRIC = {r: 1.0 if r == 0 else 4.0 + r for r in range(8)}  # rank 0 is the worst agent, the last the best


def model_of(value):
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def builder():
    model = model_of(7.0)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def weights(model):
    return sorted({v for p in model.parameters() for v in p.detach().reshape(-1).tolist()})


@check
def average_all_policy(w):
    policy = sp.AverageAllPolicy(average_every=2)
    model = model_of(w.rank + 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out, out_opt, info = policy(1, model, opt)
    assert info["averaged_this_iteration"] is False and weights(model) == [w.rank + 1.0]
    out, out_opt, info = policy(2, model, opt)
    assert out is model and out_opt is opt and info["averaged_this_iteration"] is True
    assert weights(model) == [(w.size + 1) / 2]


@check
def average_all_divides_by_the_group_size(w):
    policy = sp.AverageAllPolicympi4py(0)  # torchgfn clamps average_every to at least 1
    assert policy.average_every == 1
    model = model_of(w.rank + 1.0)
    if w.rank == 0:
        _, _, info = policy(0, model, None, group=w.new_group([0]))
        assert info["averaged_this_iteration"] and weights(model) == [1.0], "torchgfn divided by the world: 0.5"
    else:
        w.new_group([0])
    _, _, info = policy(0, model, None)
    assert info["averaged_this_iteration"] and weights(model) == [(w.size + 1) / 2]


def run_async(w, policy):
    model = model_of(w.rank + 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replaced_at = None
    for it in range(300):
        model, opt, info = policy(it, model, opt, local_metric=METRIC[w.rank])
        if info["averaged_this_iteration"] and replaced_at is None:
            replaced_at = it
        done = popmesh.all_reduce(torch.tensor([0 if replaced_at is None else 1]), "max")
        if done.item():
            break
        time.sleep(0.02)
    policy.shutdown()
    return model, replaced_at


@check
def async_policy_replaces_the_worse_rank_with_the_better_ones_weights(w):
    need_ranks(w, 2)  # a group of one never replaces anybody
    model, replaced_at = run_async(w, sp.AsyncSelectiveAveragingPolicy(builder, average_every=1))
    if w.rank == 0:  # ratio 0.2 replaces one rank, with the mean of all the others ("mean")
        assert replaced_at is not None and weights(model) == [(w.size + 2) / 2], (replaced_at, weights(model))
    else:
        assert replaced_at is None and weights(model) == [w.rank + 1.0]


@check
def async_policy_applies_momentum(w):
    need_ranks(w, 2)
    policy = sp.AsyncSelectiveAveragingPolicy(builder, 1, replacement_ratio=0.5, momentum=0.5,
                                              averaging_strategy="weighted_mean", threshold=float("inf"))
    model, _ = run_async(w, policy)
    # which donors and weights is the decision's business (population tests); the facade must apply it
    # with momentum: half the rank's own weights (1) and half its donors' combination
    decision = decide([METRIC[r] for r in range(w.size)], ReplacementRule(ratio=0.5), strategy="weighted_mean")
    assert decision.replaced == (0,)
    combined = sum(f * (d + 1.0) for d, f in zip(decision.donors[0], decision.weights[0]))
    want = 0.5 * 1.0 + 0.5 * combined if w.rank == 0 else w.rank + 1.0  # 1.5 on two ranks
    assert len(weights(model)) == 1 and math.isclose(weights(model)[0], want, rel_tol=1e-6), (weights(model), want)


@check
def async_policy_best_only_and_reset_weights(w):
    need_ranks(w, 2)
    n = w.size
    for strategy, want in (("best_only", float(n)), ("reset_weights", 7.0)):  # the best rank's weights; fresh ones
        model, replaced_at = run_async(w, sp.AsyncSelectiveAveragingPolicy(builder, 1, averaging_strategy=strategy))
        if w.rank == 0:
            assert replaced_at is not None and weights(model) == [want], (strategy, replaced_at, weights(model))
        else:
            assert replaced_at is None and weights(model) == [w.rank + 1.0], (strategy, weights(model))


@check
def async_policy_threshold_and_cooldown(w):
    need_ranks(w, 2)
    cooldown = 4  # rank 0 (metric 1) stays below the threshold: replaced again once its cooldown is over
    policy = sp.AsyncSelectiveAveragingPolicy(builder, 1, threshold=2.0, cooldown=cooldown)
    model = model_of(w.rank + 1.0)
    decided = []
    for it in range(200):
        model, _, info = policy(it, model, None, local_metric=METRIC[w.rank])
        if info["averaged_this_iteration"]:
            decided.append(info["policy_info"].decision_iteration)
        if popmesh.all_reduce(torch.tensor([len(decided)]), "max").item() >= 2:
            break
        time.sleep(0.01)
    policy.shutdown()
    if w.rank == 0:
        assert len(decided) == 2 and decided[1] - decided[0] >= cooldown, decided
    else:
        assert decided == [] and weights(model) == [w.rank + 1.0], decided


def simulate_upstream_ages(seed, age_range, calls, n, rank):
    """torchgfn's age rule with Python's random seeded as the ranks seed it: (deaths, donors per death,
    max_age after the last call). A lifetime is drawn at construction and at each death; the donors
    (max(1, int(n * 0.5)) of the other ranks) are drawn right after it."""
    rng = random.Random(seed)
    max_age, age, deaths, donors = rng.randint(*age_range), 0, [], []
    for it in range(calls):
        if age >= max_age:
            max_age, age = rng.randint(*age_range), 0
            deaths.append(it)
            if n > 1:
                donors.append(rng.sample([r for r in range(n) if r != rank], max(1, int(n * 0.5))))
        else:
            age += 1
    return deaths, donors, max_age


def run_one_sided(w, policy, calls, metric=None):
    """Call ``policy`` ``calls`` times without re-publishing (peers keep reading the first snapshot,
    rank r's weights r + 1); return the model, the iterations it was replaced at and the donors."""
    model = model_of(w.rank + 1.0)
    replaced, donors = [], []
    for it in range(calls):
        model, _, info = policy(it, model, None, METRIC[w.rank] if metric is None else metric, expose_params=False)
        assert info["replacement_mode"] == policy.replacement_mode and info["replacement_check_every"] == 5
        if info["is_replaced"]:
            replaced.append(it)
            donors.append(list(info["policy_info"].donors))
            assert weights(model) == [sum(d + 1.0 for d in donors[-1]) / len(donors[-1])], (weights(model), donors)
    popmesh.barrier()
    policy.shutdown()
    return model, replaced, donors


@check
def one_sided_age_lifetimes_follow_upstream(w):
    if not one_sided_engine(w):
        return
    n = w.size
    random.seed(1000 + w.rank)  # lifetimes and donors come from Python's random, as upstream's
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 5, age_range=(3, 3))
    assert policy.max_age == 3 and policy.age == 0
    _, replaced, donors = run_one_sided(w, policy, 12)
    assert replaced == ([3, 7, 11] if n > 1 else []), replaced  # every rank, at calls 3, 7 and 11
    assert policy.num_replacements == len(replaced) and policy.age == 0
    assert all(len(d) == max(1, n // 2) and w.rank not in d for d in donors), donors
    random.seed(2000 + w.rank)
    policy = sp.AsyncSelectiveAveragingPolicympi4pyGeneral(builder, model_of(1.0), 5, age_range=(1, 3))
    _, replaced, donors = run_one_sided(w, policy, 10)
    deaths, want_donors, max_age = simulate_upstream_ages(2000 + w.rank, (1, 3), 10, n, w.rank)
    assert (replaced, donors) == ((deaths, want_donors) if n > 1 else ([], [])), (replaced, donors, deaths)
    assert policy.max_age == max_age
    policy.reset_age()
    assert policy.age == 0 and 1 <= policy.max_age <= 3


@check
def one_sided_threshold_strategies_and_momentum(w):
    if not one_sided_engine(w):
        return
    need_ranks(w, 2)
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 5, threshold_metric=3.0,
                                                        averaging_strategy="reset_weights",
                                                        replacement_mode="threshold")
    model = model_of(w.rank + 1.0)
    for it in range(2):  # rank 0 (metric 1) is below the threshold at every call, the others never
        model, _, info = policy(it, model, None, METRIC[w.rank])
        assert info["is_replaced"] is (w.rank == 0) and "global_min_metric" not in info
    assert weights(model) == ([7.0] if w.rank == 0 else [w.rank + 1.0]), weights(model)
    assert policy.num_replacements == (2 if w.rank == 0 else 0)
    popmesh.barrier()
    policy.shutdown()
    policy = sp.AsyncSelectiveAveragingPolicympi4pyGeneral(builder, model_of(1.0), 5, threshold_metric=3.0,
                                                           momentum=0.5, replacement_mode="threshold")
    model = model_of(w.rank + 1.0)
    model, _, info = policy(0, model, None, METRIC[w.rank], expose_params=False)
    if w.rank == 0:  # half its own weights, half the mean of its random donors'
        donors = info["policy_info"].donors
        assert weights(model) == [0.5 * 1.0 + 0.5 * sum(d + 1.0 for d in donors) / len(donors)], (weights(model),
                                                                                                   donors)
    assert policy.is_agent_dying(float("nan"), 3.0), "a non-finite metric is below any threshold"
    assert raises(lambda: policy.is_agent_dying(None, 3.0))  # a clear error, not torchgfn's TypeError
    popmesh.barrier()
    policy.shutdown()


@check
def one_sided_worst_ratio_decides_at_iteration_zero(w):
    if not one_sided_engine(w):
        return
    n, best = w.size, w.size - 1
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 2, replacement_ratio=1.5,
                                                        replacement_mode="worst_ratio")
    model = model_of(w.rank + 1.0)
    for it in range(3):  # a ratio above 1 replaces all but the best, on iterations 0 and 2
        model, _, info = policy(it, model, None, METRIC[w.rank], expose_params=False)
        assert info["is_replaced"] is (it != 1 and w.rank != best), (it, info)
        assert ("global_min_metric" in info) is (it != 1)
        if it != 1:
            assert (info["global_min_metric"], info["global_max_metric"]) == (METRIC[0], METRIC[best])
    if n > 1:
        other = w.new_group([0])
        try:
            policy(4, model, None, 1.0, group=other)
        except ConfigError as e:
            assert "constructor" in str(e)
        else:
            raise AssertionError("a call's group other than the constructor's was accepted")
    popmesh.barrier()
    policy.shutdown()


def one_sided_engine(w):
    """True on the MPI engine; elsewhere check what the one-sided policies do there and return False."""
    if w.engine_name == "mpi":
        return True
    if w.size == 1:  # a world of one is the identity on every engine: nothing to read, nobody replaced
        policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 1, replacement_mode="worst_ratio")
        model = model_of(1.0)
        out, _, info = policy(0, model, None, METRIC[w.rank])
        assert out is model and info["is_replaced"] is False and weights(model) == [1.0]
        return False
    try:  # a torch world that no MPI launcher started: the constructor says how to launch
        sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 1, replacement_mode="worst_ratio")
    except ConfigError as e:
        assert "mpiexec -n" in str(e) and "AsyncSelectiveAveragingPolicy" in str(e), str(e)
    else:
        raise AssertionError("a one-sided policy was made on a torch world without MPI")
    return False


@check
def one_sided_general_worst_ratio(w):
    if w.engine_name != "mpi":
        assert raises(lambda: sp.AsyncSelectiveAveragingPolicympi4pyGeneral(builder, None, 2, replacement_mode="x"))
        return
    need_ranks(w, 2)
    policy = sp.AsyncSelectiveAveragingPolicympi4pyGeneral(builder, model_of(1.0), 2, replacement_mode="worst_ratio")
    model = model_of(w.rank + 1.0)
    _, _, info = policy(1, model, None, METRIC[w.rank])  # not a check iteration: only exposes the weights
    assert info["is_replaced"] is False
    popmesh.barrier()
    model, _, info = policy(2, model, None, METRIC[w.rank])
    extremes = (info["global_min_metric"], info["global_max_metric"])
    assert info["is_replaced"] is (w.rank == 0) and extremes == (1.0, METRIC[w.size - 1]), (info, extremes)
    donors = info["policy_info"].donors
    if w.rank == 0:  # ratio 0.2 replaces the worst rank by max(1, int(n * 0.5)) random donors among the others
        assert len(donors) == max(1, w.size // 2) and 0 not in donors, donors
        assert weights(model) == [sum(d + 1.0 for d in donors) / len(donors)], (weights(model), donors)
    else:
        assert weights(model) == [w.rank + 1.0]
    assert policy.is_agent_dying(1.0, 3.0) and not policy.is_agent_dying(5.0, 3.0)
    popmesh.barrier()
    policy.shutdown()


def raises(fn):
    try:
        fn()
    except ConfigError:
        return True
    return False


if __name__ == "__main__":
    main()
