"""popmesh.compat.spawn_policy on real worlds of 1, 2 and 3 ranks (torch or MPI engine); rank r's weights
are r + 1 and rank 0 is the worst agent."""

import math
import os
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
def one_sided_policies_need_the_mpi_engine(w):
    if w.engine_name == "mpi":
        return one_sided_fast_age_mode(w)
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 1, replacement_mode="worst_ratio")
    if w.size == 1:  # a world of one is the identity on every engine: nothing to read, nobody replaced
        model = model_of(1.0)
        out, _, info = policy(0, model, None, METRIC[w.rank])
        assert out is model and info["is_replaced"] is False and weights(model) == [1.0]
        return
    try:
        policy(0, model_of(1.0), None, METRIC[w.rank])
    except ConfigError as e:
        assert "mpi" in str(e)
    else:
        raise AssertionError("a one-sided policy ran on the torch engine")


def one_sided_fast_age_mode(w):
    need_ranks(w, 2)
    n, best = w.size, w.size - 1
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 5, age_range=(1, 1))
    model = model_of(w.rank + 1.0)
    seen = []
    for it in range(2):
        model, _, info = policy(it, model, None, METRIC[w.rank])
        seen.append(info["is_replaced"])
        assert info["replacement_mode"] == "age" and info["replacement_check_every"] == 5
        popmesh.barrier()
    policy.shutdown()
    # every agent reaches its lifetime at the second call; all but the best are replaced by it
    assert seen == [False, w.rank != best], seen
    assert weights(model) == [float(n)] and policy.num_replacements == (0 if w.rank == best else 1)
    assert policy.comm_size == n and policy.myrank == w.rank


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
    if w.rank == 0:  # ratio 0.2 replaces the worst rank by a random donor (k = n // 2) among the others
        assert len(donors) == max(1, w.size // 2) and 0 not in donors, donors
        assert weights(model) == [sum(d + 1.0 for d in donors) / len(donors)], (weights(model), donors)
    else:
        assert weights(model) == [w.rank + 1.0]
    assert policy.is_agent_dying(1.0, 3.0) and not policy.is_agent_dying(5.0, 3.0)
    policy.reset_age()
    assert policy.age == 0
    policy.shutdown()


def raises(fn):
    try:
        fn()
    except ConfigError:
        return True
    return False


if __name__ == "__main__":
    main()
