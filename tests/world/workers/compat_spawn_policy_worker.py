"""popmesh.compat.spawn_policy on a real 2-rank world (torch or MPI engine); rank r's weights are r + 1."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
import popmesh.compat.spawn_policy as sp
from popmesh import ConfigError
from worldlib import check, main

torch.set_num_threads(1)
METRIC = {0: 1.0, 1: 5.0}  # rank 0 is the worse agent


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
    assert weights(model) == [1.5]


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
    assert info["averaged_this_iteration"] and weights(model) == [1.5]


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
    model, replaced_at = run_async(w, sp.AsyncSelectiveAveragingPolicy(builder, average_every=1))
    if w.rank == 0:
        assert replaced_at is not None and weights(model) == [2.0], (replaced_at, weights(model))
    else:
        assert replaced_at is None and weights(model) == [2.0]


@check
def async_policy_applies_momentum(w):
    policy = sp.AsyncSelectiveAveragingPolicy(builder, 1, replacement_ratio=0.5, momentum=0.5,
                                              averaging_strategy="weighted_mean", threshold=float("inf"))
    model, _ = run_async(w, policy)
    assert weights(model) == ([1.5] if w.rank == 0 else [2.0]), weights(model)


@check
def one_sided_policies_need_the_mpi_engine(w):
    if w.engine_name == "mpi":
        return one_sided_fast_age_mode(w)
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 1, replacement_mode="worst_ratio")
    try:
        policy(0, model_of(1.0), None, METRIC[w.rank])
    except ConfigError as e:
        assert "mpi" in str(e)
    else:
        raise AssertionError("a one-sided policy ran on the torch engine")


def one_sided_fast_age_mode(w):
    policy = sp.AsyncSelectiveAveragingPolicympi4pyFast(builder, model_of(1.0), 5, age_range=(1, 1))
    model = model_of(w.rank + 1.0)
    seen = []
    for it in range(2):
        model, _, info = policy(it, model, None, METRIC[w.rank])
        seen.append(info["is_replaced"])
        assert info["replacement_mode"] == "age" and info["replacement_check_every"] == 5
        popmesh.barrier()
    policy.shutdown()
    assert seen == ([False, True] if w.rank == 0 else [False, False]), seen
    assert weights(model) == [2.0] and policy.num_replacements == (1 if w.rank == 0 else 0)
    assert policy.comm_size == 2 and policy.myrank == w.rank


@check
def one_sided_general_worst_ratio(w):
    if w.engine_name != "mpi":
        assert raises(lambda: sp.AsyncSelectiveAveragingPolicympi4pyGeneral(builder, None, 2, replacement_mode="x"))
        return
    policy = sp.AsyncSelectiveAveragingPolicympi4pyGeneral(builder, model_of(1.0), 2, replacement_mode="worst_ratio")
    model = model_of(w.rank + 1.0)
    _, _, info = policy(1, model, None, METRIC[w.rank])  # not a check iteration: only exposes the weights
    assert info["is_replaced"] is False
    popmesh.barrier()
    model, _, info = policy(2, model, None, METRIC[w.rank])
    assert info["is_replaced"] is (w.rank == 0) and (info["global_min_metric"], info["global_max_metric"]) == (1.0, 5.0)
    assert weights(model) == [2.0]
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
