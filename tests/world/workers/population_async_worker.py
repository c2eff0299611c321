"""AsyncSelectiveAveraging on a real world (torch/gloo and MPI): closed forms, conformance with the
synchronous policy, the coordinator as donor and as replaced, a dedicated coordinator, sub-groups.
Most use decide="complete" (every rank's metric of the round, then one decision); the default,
decide="latest", is here for what travels with the weights (the explored hyper-parameters, the true
objective, a reference agent) and in population_async_slow_worker.py for not waiting."""

import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh import ConfigError, PopmeshError
from popmesh.population import (
    AsyncSelectiveAveraging,
    Continuous,
    Explore,
    ReplacementRule,
    SelectiveAveraging,
    decide,
)
from popmesh.population.decisions.hparams import assign
from workers.population_common import adam_for, assert_all, exp_avg_of, make_agent, mean, values
from worldlib import check, main, need_ranks

QUARTER = ReplacementRule(ratio=0.25)
WORST_FIRST = {1: [1.0], 2: [1.0, 2.0], 3: [1.0, 3.0, 2.0], 4: [1.0, 4.0, 2.0, 3.0]}
WAIT_S = 30.0


def until_applied(policy, model, optimizer=None, iteration=1, group=None):
    """Call the policy off-cadence until it swaps a replacement in; return that call's result."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        model, optimizer, info = policy(iteration, model, optimizer, None, group=group)
        if info.replaced:
            return model, optimizer, info
        time.sleep(0.005)
    raise AssertionError(f"no replacement was applied within {WAIT_S} s")


def one_round(w, policy, metrics, model=None, optimizer=None, replaced=(), group=None):
    model = make_agent(w.rank + 1) if model is None else model
    _, optimizer, info = policy(0, model, optimizer, metrics[w.rank], group=group)
    assert not info.replaced and info.acted
    if w.rank in replaced:
        before = values(model).copy()
        model, optimizer, info = until_applied(policy, model, optimizer, group=group)
        assert not np.array_equal(before, values(model)), "the applied weights must differ from the old ones"
    policy.shutdown(timeout=WAIT_S)
    return model, optimizer, info


@check
def averaged_weights_are_applied(w):
    """Regression for torchgfn's bug: after the applying call, weights are the expected combination."""
    n = w.size
    policy = AsyncSelectiveAveraging(every=10, decide="complete", rule=QUARTER)
    model, _, info = one_round(w, policy, WORST_FIRST[n], replaced=(0,) if n > 1 else ())
    if w.rank == 0 and n > 1:
        assert_all(model, mean([r + 1 for r in range(1, n)]), what="coordinator replaced by the others' mean")
        assert info.donors == tuple(range(1, n)) and info.decision_iteration == 0 and info.optimizer == "reset"
        assert info.metrics == {r: WORST_FIRST[n][r] for r in range(n)}
    else:
        assert_all(model, w.rank + 1, what="not replaced")


@check
def coordinator_donates_best_only(w):
    n = w.size
    need_ranks(w, 2)
    metrics = [float(n - r) for r in range(n)]  # rank 0 (the coordinator) is the best
    policy = AsyncSelectiveAveraging(every=10, decide="complete", rule=QUARTER, strategy="best_only")
    model, _, _info = one_round(w, policy, metrics, replaced=(n - 1,))
    assert_all(model, 1.0 if w.rank == n - 1 else w.rank + 1, what="best_only from the coordinator")


@check
def conforms_to_the_synchronous_policy(w):
    """Three rounds with training in between: async and sync end with the same weights on every rank."""
    n = w.size
    need_ranks(w, 3)
    opts = dict(rule=ReplacementRule(ratio=0.5), strategy="weighted_mean", momentum=0.3)
    asyn, sync = AsyncSelectiveAveraging(every=5, decide="complete", **opts), SelectiveAveraging(every=5, **opts)
    model_a, model_s = make_agent(w.rank + 1), make_agent(w.rank + 1)
    rng = np.random.default_rng(11)
    for round_ in range(3):
        metrics = [float(x) for x in rng.permutation(n) + 1]
        if round_ == 2:
            metrics[1] = math.nan
        for m in (model_a, model_s):
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.25 * (w.rank + 1) * (round_ + 1))
        it = 5 * round_
        expected = decide(metrics, opts["rule"], strategy="weighted_mean", iteration=it)
        asyn(it, model_a, None, metrics[w.rank])
        if w.rank in expected.replaced:
            _, _, info = until_applied(asyn, model_a, iteration=it + 1)
            assert info.decision_iteration == it
        sync(it, model_s, None, metrics[w.rank])
        popmesh.barrier()
        for (name, pa), ps in zip(model_a.named_parameters(), model_s.parameters()):
            tol = 2e-3 if pa.dtype == torch.float16 else 1e-5
            assert torch.allclose(pa.double(), ps.double(), rtol=tol, atol=tol), (round_, name, pa, ps)
    asyn.shutdown(timeout=WAIT_S)


@check
def optimizer_state_is_copied_from_the_best_donor(w):
    n = w.size
    need_ranks(w, 2)
    model = make_agent(w.rank + 1)
    opt = adam_for(model, grad=w.rank + 1)
    best = int(np.argmax(WORST_FIRST[n]))
    policy = AsyncSelectiveAveraging(every=10, decide="complete", rule=QUARTER, optimizer_policy="copy")
    model, opt, info = one_round(w, policy, WORST_FIRST[n], model=model, optimizer=opt, replaced=(0,))
    assert math.isclose(exp_avg_of(opt), 0.1 * ((best if w.rank == 0 else w.rank) + 1), rel_tol=1e-5)
    if w.rank == 0:
        assert info.optimizer == f"copied from {best}"


@check
def events_and_reset_weights(w):
    n = w.size
    need_ranks(w, 2)
    path = os.path.join(os.environ["POPMESH_TEST_OUT"], "async-events-{rank}.jsonl")
    policy = AsyncSelectiveAveraging(every=10, decide="complete", rule=QUARTER, strategy="reset_weights",
                                     model_builder=lambda: make_agent(-1.0), events_path=path)
    model, _, _info = one_round(w, policy, WORST_FIRST[n], replaced=(0,))
    assert_all(model, -1.0 if w.rank == 0 else w.rank + 1, what="reset_weights")
    mine = path.format(rank=w.rank)
    if w.rank == 0:
        with open(mine) as f:
            (event,) = [json.loads(line) for line in f]
        assert event["policy"] == "async_selective" and event["decision_iteration"] == 0 and event["donors"] == []
    else:
        assert not os.path.exists(mine)


@check
def dedicated_coordinator_rank(w):
    n = w.size
    need_ranks(w, 3)
    trainers = list(range(n - 1))
    group = w.new_group(trainers)
    policy = AsyncSelectiveAveraging(every=10, decide="complete", rule=QUARTER, coordinator=n - 1)
    if w.rank == n - 1:
        assert policy.coordinate(group, timeout=WAIT_S) == 1
        return
    model, _, _info = one_round(w, policy, WORST_FIRST[n - 1], replaced=(0,), group=group)
    assert_all(model, mean([r + 1 for r in range(1, n - 1)]) if w.rank == 0 else w.rank + 1, what="dedicated")


@check
def sub_group_with_an_idle_rank(w):
    n = w.size
    need_ranks(w, 3)
    group = w.new_group(range(1, n))  # rank 0 idles; rank 1 coordinates and is replaced
    policy = AsyncSelectiveAveraging(every=10, decide="complete", rule=QUARTER)
    if w.rank == 0:
        return
    metrics = {g: float(g + 1) for g in range(1, n)}
    model, _, info = one_round(w, policy, metrics, replaced=(1,), group=group)
    assert_all(model, mean([g + 1 for g in range(2, n)]) if w.rank == 1 else w.rank + 1, what="sub-group")
    if w.rank == 1:
        assert set(info.metrics) == set(range(1, n))


@check
def shutdown_is_idempotent_and_final(w):
    policy = AsyncSelectiveAveraging(every=10, rule=QUARTER)
    model = make_agent(1.0)
    policy(3, model, None, None)
    policy.shutdown(timeout=WAIT_S)
    policy.shutdown(timeout=WAIT_S)
    if w.size > 1:
        try:
            policy(4, model, None, None)
        except PopmeshError as e:
            assert "shut down" in str(e)
        else:
            raise AssertionError("a shut-down policy must refuse further calls")
    try:
        AsyncSelectiveAveraging(every=10, poll_interval=0)
    except ConfigError:
        pass
    else:
        raise AssertionError("poll_interval=0 must be refused")


EXPLORED = Explore(keys=("lr", "ent"), space={"lr": Continuous(1e-5, 1e-1, log=True),
                                              "ent": Continuous(1e-4, 1e-1, log=True)})


def report_until_replaced(policy, model, optimizer, metric, objective, hparams):
    """Report at decision points 0, 10, 20, ... until a replacement is applied (the first report may be
    judged before the others' arrive); off-cadence calls in between swap it in."""
    deadline, iteration = time.monotonic() + WAIT_S, 0
    while time.monotonic() < deadline:
        model, optimizer, info = policy(iteration, model, optimizer, metric, objective=objective, hparams=hparams)
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            model, optimizer, info = policy(iteration + 1, model, optimizer, None)
            if info.replaced:
                return model, optimizer, info
            time.sleep(0.005)
        iteration += 10
    raise AssertionError(f"no replacement was applied within {WAIT_S} s")


def latest_round(w, reference=None):
    """Objectives 100 - r (within the relative gap of each other) and 10 for the last rank, training
    metrics the other way round; each rank's learning rate and entropy coefficient 1e-3 * (r + 1).
    The last rank is replaced by the best non-reference rank; returns (model, optimizer, info, donor)."""
    last = w.size - 1
    policy = AsyncSelectiveAveraging(every=10, explore=EXPLORED, seed=11, reference=reference)
    model = make_agent(w.rank + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * (w.rank + 1))
    objective, metric = (10.0, 1e6) if w.rank == last else (100.0 - w.rank, float(w.rank))
    hparams = {"ent": 1e-3 * (w.rank + 1)}
    info = None
    if w.rank != last:
        model, optimizer, info = policy(0, model, optimizer, metric, objective=objective, hparams=hparams)
    popmesh.barrier()
    if w.rank == last:
        model, optimizer, info = report_until_replaced(policy, model, optimizer, metric, objective, hparams)
    policy.shutdown(timeout=WAIT_S)
    return model, optimizer, info, 1 if reference == 0 else 0


@check
def latest_hands_over_the_donors_hyper_parameters_explored(w):
    """decide="latest": the replaced rank starts from its donor's learning rate and entropy coefficient,
    moved by the explore step the coordinator seeded; the learning rate is set in its optimizer and
    info.hparams says what to train at. It was ranked by its objective, not its training metric."""
    need_ranks(w, 2)
    model, optimizer, info, donor = latest_round(w)
    if w.rank != w.size - 1:
        assert_all(model, w.rank + 1, what="not replaced")
        return
    inherited = {"lr": 1e-3 * (donor + 1), "ent": 1e-3 * (donor + 1)}
    assert info.donors == (donor,) and info.inherited == inherited, (info.donors, info.inherited)
    expected = assign(inherited, EXPLORED, 11, 0, w.size - 1)
    assert info.hparams_now == expected and info.hparams["lr"][0] == 1e-3 * w.size, info.hparams
    assert optimizer.param_groups[0]["lr"] == expected["lr"]
    assert_all(model, donor + 1, what="the donor's weights")


@check
def a_rank_that_never_called_the_policy_still_shakes_hands_at_shutdown(w):
    """A rank that stopped before its first decision point (the demo's --stop-at-target can do that)
    calls only shutdown: nobody waits for its goodbye, whether it is a trainer or the coordinator."""
    need_ranks(w, 2)
    for silent in (w.size - 1, 0):
        policy = AsyncSelectiveAveraging(every=10)
        if w.rank != silent:
            policy(0, make_agent(w.rank + 1), None, float(w.rank))
        started = time.monotonic()
        policy.shutdown(timeout=WAIT_S)
        assert time.monotonic() - started < 10.0, f"shutdown took {time.monotonic() - started:.1f} s"


@check
def a_reference_agent_is_never_compared_or_a_donor(w):
    need_ranks(w, 3)
    model, _, info, _donor = latest_round(w, reference=0)
    if w.rank == w.size - 1:
        assert info.donors == (1,) and math.isnan(info.metrics[0]), (info.donors, info.metrics)  # not compared
        assert_all(model, 2.0, what="the best member that is not the reference")
    else:
        assert_all(model, w.rank + 1, what="not replaced")


if __name__ == "__main__":
    main()
