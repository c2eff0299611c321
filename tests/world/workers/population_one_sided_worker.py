"""OneSidedAveraging and the MPI snapshot windows under mpiexec: closed forms and tear-free reads."""

import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import popmesh
from popmesh.population import OneSidedAveraging, ReplacementRule
from workers.population_common import adam_for, assert_all, exp_avg_of, make_agent, mean
from worldlib import check, main, need_ranks

QUARTER = ReplacementRule(ratio=0.25)
WORST_FIRST = {1: [1.0], 2: [1.0, 2.0], 3: [1.0, 3.0, 2.0], 4: [1.0, 4.0, 2.0, 3.0]}


def decide_once(w, policy, metrics, model=None, optimizer=None, group=None, iteration=10):
    """Everyone publishes first (so every read sees every metric), then every rank decides."""
    model = make_agent(w.rank + 1) if model is None else model
    policy.publish(0, model, optimizer, metrics[w.rank], group=group)
    popmesh.barrier(group=group)
    out = policy(iteration, model, optimizer, metrics[w.rank], group=group)
    popmesh.barrier(group=group)
    policy.close()
    return out


@check
def reads_are_never_torn(w):
    need_ranks(w, 2)
    words = 1 << 17  # 1 MiB of float64 per snapshot
    window = w.engine.snapshot_window(w.handle, words * 8)
    reads = torn = published = 0
    buf = np.empty(words)
    stop = time.monotonic() + 1.5
    while time.monotonic() < stop:
        if w.rank == 0:
            published += 1
            buf[:] = published
            window.publish(buf.view(np.uint8), published, float(published))
        else:
            snap = window.read(0, timeout=10)
            if snap is None:
                continue
            v = snap.data.view(np.float64)
            reads += 1
            torn += int(not (np.all(v == v[0]) and v[0] == snap.iteration == snap.metric))
    popmesh.barrier()
    window.free()
    assert torn == 0, f"{torn} of {reads} reads were torn"
    assert w.rank == 0 or reads > 10, f"only {reads} reads"


@check
def rank0_replaced_by_mean_of_others(w):
    n = w.size
    model, _, info = decide_once(w, OneSidedAveraging(every=10, rule=QUARTER), WORST_FIRST[n])
    if n == 1:
        assert not info.replaced
        return
    assert info.metrics == {r: WORST_FIRST[n][r] for r in range(n)}, info.metrics
    expected = mean([r + 1 for r in range(1, n)]) if w.rank == 0 else w.rank + 1
    assert_all(model, expected, what="one-sided mean")
    assert info.replaced == (w.rank == 0) and (w.rank != 0 or info.donors == tuple(range(1, n)))


@check
def rank0_donates_best_only_with_momentum(w):
    n = w.size
    need_ranks(w, 2)
    metrics = [float(n - r) for r in range(n)]
    policy = OneSidedAveraging(every=5, rule=QUARTER, strategy="best_only", momentum=0.5)
    model, _, _info = decide_once(w, policy, metrics)
    expected = 0.5 * n + 0.5 * 1.0 if w.rank == n - 1 else w.rank + 1
    assert_all(model, expected, what="best_only from rank 0 with momentum")


@check
def nan_metric_never_donates(w):
    n = w.size
    need_ranks(w, 3)
    metrics = [float(r + 1) for r in range(n)]
    metrics[1] = math.nan
    model, _, _info = decide_once(w, OneSidedAveraging(every=5, rule=QUARTER), metrics)
    expected = mean([r + 1 for r in range(n) if r != 1]) if w.rank == 1 else w.rank + 1
    assert_all(model, expected, what="NaN rank replaced")


@check
def optimizer_copy_moves_adam_state(w):
    n = w.size
    need_ranks(w, 2)
    model = make_agent(w.rank + 1)
    opt = adam_for(model, grad=w.rank + 1)
    best = int(np.argmax(WORST_FIRST[n]))
    policy = OneSidedAveraging(every=5, rule=QUARTER, optimizer_policy="copy", include_buffers=True)
    model, new_opt, info = decide_once(w, policy, WORST_FIRST[n], model=model, optimizer=opt)
    assert math.isclose(exp_avg_of(new_opt), 0.1 * ((best if w.rank == 0 else w.rank) + 1), rel_tol=1e-5)
    if w.rank == 0:
        assert info.optimizer == f"copied from {best}"
        assert np.allclose(model.norm.running_mean.numpy(), mean(range(2, n + 1)))


@check
def reset_weights_and_default_optimizer_reset(w):
    n = w.size
    need_ranks(w, 2)
    model = make_agent(w.rank + 1)
    opt = adam_for(model)
    policy = OneSidedAveraging(every=5, rule=QUARTER, strategy="reset_weights", model_builder=lambda: make_agent(-2.0))
    model, opt, _info = decide_once(w, policy, WORST_FIRST[n], model=model, optimizer=opt)
    assert_all(model, -2.0 if w.rank == 0 else w.rank + 1, what="reset_weights")
    assert (exp_avg_of(opt) is None) == (w.rank == 0)


@check
def sub_group_with_an_idle_rank(w):
    n = w.size
    need_ranks(w, 3)
    group = w.new_group(range(n - 1))
    if w.rank == n - 1:
        return
    metrics = [1.0] + [float(r + 1) for r in range(1, n - 1)]
    model, _, info = decide_once(w, OneSidedAveraging(every=5, rule=QUARTER), metrics, group=group)
    expected = mean([r + 1 for r in range(1, n - 1)]) if w.rank == 0 else w.rank + 1
    assert_all(model, expected, what="one-sided over a sub-group")
    assert set(info.metrics) == set(range(n - 1))


@check
def off_cadence_calls_are_free(w):
    policy = OneSidedAveraging(every=5, rule=QUARTER)
    model = make_agent(w.rank + 1)
    _, _, info = policy(3, model, None, None)
    assert not info.acted and policy._exposures == {}


if __name__ == "__main__":
    main()
