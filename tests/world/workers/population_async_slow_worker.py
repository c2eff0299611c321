"""AsyncSelectiveAveraging with one rank five times slower than the others (4 ranks, torch/gloo and MPI).

Every iteration sleeps: ``ITER_S`` on the fast ranks, five times that on the last rank. Metrics are
constants (rank 0 the worst, then the other fast ranks, the slow rank second best, rank n - 2 the
best), the weights each rank's value ``rank + 1`` (closed forms). With ``decide="latest"`` a fast
rank's replacement is applied one or two of its own iterations after the report that decided it,
while the slow rank lags many iterations behind; with ``decide="complete"`` every decision waits
until the slow rank reported the iteration.
"""

import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from popmesh import ConfigError
from popmesh.population import AsyncSelectiveAveraging
from workers.population_common import make_agent, values
from worldlib import check, main, need_ranks

ITER_S = 0.1  # an iteration of a small RL learner; the demo's take 0.1-0.2 s on 2 shared cores
SLOWER = 5
EVERY = 2
WAIT_S = 60.0


def metric_of(rank, n):
    """Rank 0 is the worst, then ranks 1..n-3; the slow rank (n - 1) is second best, rank n - 2 the best."""
    return 1.0 + rank if rank < n - 2 else float(n + 1) if rank == n - 2 else float(n)


def train(w, policy, iterations):
    """Run ``iterations`` paced iterations; return the replacements applied on this rank as
    (applied iteration, decision iteration, report_iterations, weights after)."""
    n, slow = w.size, w.size - 1
    model = make_agent(w.rank + 1)
    applied = []
    for it in range(iterations):
        time.sleep(ITER_S * (SLOWER if w.rank == slow else 1))
        due = it % EVERY == 0
        model, _, info = policy(it, model, None, metric_of(w.rank, n) if due else None, steps=100 * it)
        if info.replaced:
            applied.append((it, info.decision_iteration, dict(info.report_iterations), values(model).copy(),
                            info.donors))
    policy.shutdown(timeout=WAIT_S)
    return applied


@check
def a_nan_metric_is_refused_naming_the_rank(w):
    """Refused at the call, before anything is sent (so nobody waits for that rank's report)."""
    need_ranks(w, 2)
    policy = AsyncSelectiveAveraging(EVERY)
    try:
        policy(0, make_agent(1.0), None, math.nan)
    except ConfigError as e:
        assert f"rank {w.rank} " in str(e) and "finite" in str(e), str(e)
    else:
        raise AssertionError("a NaN metric must be refused with decide='latest'")
    policy.shutdown(timeout=WAIT_S)


@check
def slow_rank_does_not_delay_the_others_replacements(w):
    need_ranks(w, 4)
    n, slow = w.size, w.size - 1
    path = os.path.join(os.environ["POPMESH_TEST_OUT"], "slow-events-{rank}.jsonl")
    # the best (n + 1) does not lead the slow rank (n) by 30 %: the slow rank is never replaced
    policy = AsyncSelectiveAveraging(EVERY, poll_interval=0.01, events_path=path, latest={"relative_gap": 0.3})
    applied = train(w, policy, 6 if w.rank == slow else 6 * SLOWER)
    for it, decided, seen, weights, donors in applied:  # once the best (rank n - 2) reported, it is the donor
        if n - 2 in seen:
            assert donors == (n - 2,) and abs(float(weights.mean()) - (n - 1)) < 1e-6, (it, decided, donors, weights)
        assert float(weights.std()) < 1e-6, (it, decided, weights)
    if w.rank == 0:  # the worst is replaced at each of its reports, whatever the slow rank is doing
        lags = [it - decided for it, decided, *_ in applied]
        print(f"rank 0 on {w.engine_name}: lags {lags}", flush=True)
        assert len(lags) >= 8, f"rank 0 was replaced {len(lags)} times in {6 * SLOWER} iterations: {lags}"
        # the goal: median 1, 95th percentile 2; now and then on a loaded box one lands at 3
        assert statistics.median(lags) <= 1 and sorted(lags)[int(0.9 * (len(lags) - 1))] <= 2 and max(lags) <= 4, (
            f"lags (applied - decided) {lags}")
        behind = [decided - seen[slow] for _, decided, seen, *_ in applied if slow in seen]  # once it reported
        assert len(behind) >= len(applied) // 2 and max(behind) >= 10, f"never far behind at a decision: {behind}"
        with open(path.format(rank=0)) as f:
            events = [json.loads(line) for line in f]
        assert len(events) == len(applied)
        assert [e["decision_iteration"] for e in events] == [decided for _, decided, *_ in applied]
    if w.rank in range(1, n - 1):  # replaced while rank 0's replacement is in flight, through the
        # coordinator's message and a donor's stream both woken by arrival: 3 was seen now and then on gloo
        lags = [it - decided for it, decided, *_ in applied if decided > 0]  # iteration 0 opens connections
        assert not lags or (statistics.median(lags) <= 1 and max(lags) <= 4), f"lags (applied - decided) {lags}"
    if w.rank == slow:
        assert not applied, applied


@check
def complete_mode_waits_for_the_slow_rank(w):
    """The seed-compatible protocol: a decision reads every member's report of one iteration."""
    need_ranks(w, 4)
    n, slow = w.size, w.size - 1
    policy = AsyncSelectiveAveraging(EVERY, decide="complete", poll_interval=0.01)
    applied = train(w, policy, 4 if w.rank == slow else 4 * SLOWER)
    for it, decided, seen, weights, _ in applied:
        assert seen == {r: decided for r in range(n)}, (it, decided, seen)
        if w.rank == 0:  # the worst quarter (rank 0) takes the mean of all others, (2 + ... + n) / (n - 1)
            assert abs(float(weights.mean()) - sum(range(2, n + 1)) / (n - 1)) < 1e-6
    if w.rank == 0:
        assert applied, "rank 0 was never replaced"
        lags = [it - decided for it, decided, *_ in applied]
        if len(lags) > 1:  # after iteration 0 every decision waited for the slow rank's report
            assert max(lags) >= 4, f"lags (applied - decided) {lags}: the complete protocol did not wait"
    else:  # the worst quarter of four is rank 0 alone
        assert not applied, applied


if __name__ == "__main__":
    main()
