"""A peer dies while the asynchronous policy runs: survivors get a clear error quickly, never a hang."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from popmesh import CommTimeout, PeerFailure
from popmesh.population import AsyncSelectiveAveraging, ReplacementRule
from workers.population_common import make_agent
from worldlib import check, main

DEAD = 2
SHUTDOWN_S = 3.0


WHO_DIES = os.environ.get("POPMESH_TEST_DEAD", "replaced")


@check
def dead_peer_surfaces_at_shutdown(w):
    if WHO_DIES != "replaced":
        return
    policy = AsyncSelectiveAveraging(every=10, rule=ReplacementRule(ratio=0.25))
    model = make_agent(w.rank + 1)
    metrics = [3.0, 2.0, 1.0]  # the rank that dies is the one replaced
    policy(0, model, None, metrics[w.rank])
    if w.rank == DEAD:
        time.sleep(0.3)
        os._exit(3)
    time.sleep(1.0)
    start = time.monotonic()
    try:
        policy.shutdown(timeout=SHUTDOWN_S)
    except (PeerFailure, CommTimeout) as e:
        elapsed = time.monotonic() - start
        assert elapsed < SHUTDOWN_S + 8, f"took {elapsed:.1f} s"
        assert str(DEAD) in str(e), str(e)
        if w.rank == 0:  # the heartbeat (or the shutdown's own wait) names the lost rank
            assert ("did not shut the policy down" in str(e) or "did not finish" in str(e)
                    or f"rank {DEAD} closed its connection" in str(e)), str(e)
    else:
        raise AssertionError("shutting down with a dead peer must raise")


@check
def dead_donor_surfaces_on_the_replaced_rank(w):
    """Rank 2 is replaced by ranks 0 and 1; rank 1 dies when asked to donate, so rank 2 receives one
    stream of two and must fail at its deadline naming the silent donor, not wait forever."""
    if WHO_DIES != "donor":
        return
    from popmesh.population.mechanisms.asynchronous import trainer as async_trainer

    if w.rank == 1:
        async_trainer.TrainerLink._decision = lambda self, message: os._exit(3)
    policy = AsyncSelectiveAveraging(every=10, decide="complete", rule=ReplacementRule(ratio=0.25),
                                     timeout=SHUTDOWN_S)  # both others donate: a decision of all three
    model = make_agent(w.rank + 1)
    policy(0, model, None, [3.0, 2.0, 1.0][w.rank])
    start = time.monotonic()
    try:
        while time.monotonic() - start < SHUTDOWN_S + 10:  # keep training: the error surfaces at a call
            policy(1, model, None, None)
            time.sleep(0.01)
        policy.shutdown()
    except (PeerFailure, CommTimeout) as e:
        assert time.monotonic() - start < SHUTDOWN_S + 10, "took too long"
        assert "1" in str(e), str(e)
        if w.rank == 2:  # its deadline names the silent donor, or the heartbeat the dead rank
            assert "donor" in str(e) or "rank 1 closed its connection" in str(e), str(e)
    else:
        raise AssertionError("a dead donor must surface as an error")


@check
def lost_member_surfaces_while_training(w):
    """Rank 2 is SIGKILLed or SIGSTOPped mid-training, with no launcher to tear the world down: the
    survivors, still training (calls that never block), get a PeerFailure naming it within seconds
    of the heartbeat timeout, not never."""
    if WHO_DIES not in ("killed", "frozen"):
        return
    import signal

    import numpy as np

    import popmesh

    pids = [int(p) for p in popmesh.all_gather(np.array(os.getpid()))]
    policy = AsyncSelectiveAveraging(every=10, rule=ReplacementRule(ratio=0.25), timeout=300)
    model = make_agent(w.rank + 1)
    policy(0, model, None, [3.0, 2.0, 1.0][w.rank])
    if w.rank == DEAD:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL if WHO_DIES == "killed" else signal.SIGSTOP)
    start = time.monotonic()
    try:
        step = 1
        while time.monotonic() - start < 30:
            policy(step, model, None, 1.0 if step % 10 == 0 else None)
            step += 1
            time.sleep(0.01)
    except PeerFailure as e:
        elapsed = time.monotonic() - start
        assert elapsed < 12, f"noticed after {elapsed:.1f} s"
        # The rank that finds the loss names it. On gloo it then closes its connections, which ends
        # its whole gloo context, so a survivor may meet that closure before the notice naming the lost
        # rank: it then names the finder.
        if w.rank == 0:
            assert DEAD in e.ranks and f"rank {DEAD}" in str(e), str(e)
        else:
            assert DEAD in e.ranks or 0 in e.ranks, str(e)
        print(f"rank {w.rank} noticed the loss of rank {DEAD} after {elapsed:.1f} s: {e}", flush=True)
        if w.rank == 0 and WHO_DIES == "frozen":
            time.sleep(2.0)  # let rank 1 notice before this rank leaves
            os.kill(pids[DEAD], signal.SIGKILL)  # it would never end by itself
    else:
        raise AssertionError("training went on for 30 s beside a lost member")


@check
def peers_finalizing_first_is_no_error(w):
    """Rank 1's policy thread reads FIN only after every peer has finalized its world (a loaded box):
    their orderly goodbyes must not surface as an error (they did, from its data channel)."""
    if WHO_DIES != "nobody":
        return
    if w.rank == 1:
        from popmesh.population.mechanisms.asynchronous import runtime as async_runtime

        step = async_runtime.Runtime._step

        def late_step(self):
            if self._bye_sent:
                time.sleep(1.0)  # long enough for the others to get FIN, finish and finalize
            return step(self)

        async_runtime.Runtime._step = late_step
    policy = AsyncSelectiveAveraging(every=10, rule=ReplacementRule(ratio=0.25))
    policy(3, make_agent(1.0), None, None)
    policy.shutdown(timeout=SHUTDOWN_S)  # the last check: every rank finalizes right after it


if __name__ == "__main__":
    main()
