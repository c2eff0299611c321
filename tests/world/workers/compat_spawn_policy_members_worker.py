"""spawn_policy's ``participant_group_ranks`` and ``coordinator_group_rank`` on real worlds of 3 and 4 ranks:
rank r's weights are r + 1 and its metric ranks it (rank 0 the worst, rank 1 the worst of the others).

Rank 0 never takes part, so the worst agent of the population is never replaced and keeps its own weights;
among the participants 1..n-1 rank 1 is replaced by the mean of 2..n-1. Every rank creates every policy
(popmesh's asynchronous policies take channels in creation order)."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
import popmesh.compat.spawn_policy as sp
from popmesh import ConfigError
from popmesh.core.errors import NotInGroup
from workers.compat_spawn_policy_worker import METRIC, builder, model_of, weights
from worldlib import check, main, need_ranks

torch.set_num_threads(1)


def run(w, policy, calls=True, **group):
    """Call ``policy`` every iteration (if ``calls``) until some rank was replaced; every rank of the world
    agrees on when to stop. Returns the model, the iterations this rank was replaced at, and its last info."""
    model = model_of(w.rank + 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replaced, info = [], None
    for it in range(400):
        if calls:
            model, opt, info = policy(it, model, opt, local_metric=METRIC[w.rank], **group)
            replaced += [it] if info["averaged_this_iteration"] else []
        if popmesh.all_reduce(torch.tensor([len(replaced)]), "max").item():
            break
        time.sleep(0.02)
    if calls:
        policy.shutdown()
    return model, replaced, info


def check_outcome(w, model, replaced, info, donors):
    """Rank 1 took the mean of ``donors``' weights; everyone else kept their own, rank 0 never took part."""
    if w.rank == 1:
        assert len(replaced) == 1 and weights(model) == [sum(d + 1.0 for d in donors) / len(donors)], weights(model)
        assert set(info["policy_info"].donors) == set(donors), info["policy_info"]
    else:
        assert replaced == [] and weights(model) == [w.rank + 1.0], (replaced, weights(model))
    if w.rank == 0:
        assert info["policy_info"].summary == "not a participant" and not info["policy_info"].acted


@check
def participants_only_and_a_coordinator_at_a_later_group_rank(w):
    n = w.size
    policy = sp.AsyncSelectiveAveragingPolicy(builder, 1, coordinator_group_rank=n - 1,
                                              participant_group_ranks=list(range(n - 1, 0, -1)) + [1])
    model, replaced, info = run(w, policy)
    check_outcome(w, model, replaced, info, range(2, n))
    assert policy.num_training_ranks == n - 1  # deduplicated, as torchgfn does
    assert policy.participant_group_ranks == [*range(n - 1, 0, -1), 1] and policy.coordinator_group_rank == n - 1


@check
def a_coordinator_outside_the_participants_serves_them(w):
    """Group rank 0 coordinates without taking part: it decides from a thread of its own, and its shutdown
    waits for every participant's."""
    n = w.size
    policy = sp.AsyncSelectiveAveragingPolicy(builder, 1, participant_group_ranks=list(range(1, n)),
                                              averaging_strategy="best_only")
    model, replaced, info = run(w, policy)
    if w.rank == 1:  # best_only: the best participant's weights
        assert len(replaced) == 1 and weights(model) == [float(n)], weights(model)
    else:
        assert replaced == [] and weights(model) == [w.rank + 1.0], (replaced, weights(model))
    if w.rank == 0:
        assert info["policy_info"].summary == "not a participant" and not info["policy_info"].acted


@check
def group_ranks_are_ranks_of_the_group_passed_to_the_call(w):
    """In the group of global ranks 1..3, group rank 2 (global 3) coordinates group ranks 0 and 1 (global 1
    and 2); global 0 is outside the group and calls nothing (a call is NotInGroup)."""
    need_ranks(w, 4)
    group = w.new_group([1, 2, 3])
    policy = sp.AsyncSelectiveAveragingPolicy(builder, 1, coordinator_group_rank=2, participant_group_ranks=[0, 1])
    if w.rank == 0:
        try:
            policy(0, model_of(1.0), None, local_metric=1.0, group=group)
        except NotInGroup:
            pass
        else:
            raise AssertionError("a rank outside the group must not call the policy")
    model, replaced, info = run(w, policy, calls=w.rank != 0, group=group)
    if w.rank == 1:
        assert len(replaced) == 1 and weights(model) == [3.0], weights(model)
    else:
        assert replaced == [] and weights(model) == [w.rank + 1.0], (replaced, weights(model))
    if w.rank == 3:
        assert info["policy_info"].summary == "not a participant"


@check
def ranks_outside_the_group_are_config_errors_naming_the_group_size(w):
    n = w.size
    for kwargs, words in (({"participant_group_ranks": [0, n]}, f"participant_group_ranks has [{n}], not ranks of "
                                                                f"the group of {n}"),
                          ({"coordinator_group_rank": n}, f"coordinator_group_rank={n} is not a rank of the group "
                                                          f"of {n}")):
        policy = sp.AsyncSelectiveAveragingPolicy(builder, 1, **kwargs)
        try:
            policy(0, model_of(1.0), None, local_metric=1.0)
        except ConfigError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs} must be refused")
    popmesh.barrier(timeout=60)


if __name__ == "__main__":
    main()
