"""A peer dies while the asynchronous policy runs: survivors get a clear error quickly, never a hang."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from popmesh import CommTimeout, PeerFailure  # noqa: E402
from popmesh.population import AsyncSelectiveAveraging, ReplacementRule  # noqa: E402
from worldlib import check, main  # noqa: E402
from workers.population_common import make_agent  # noqa: E402

DEAD = 2
SHUTDOWN_S = 3.0


@check
def dead_peer_surfaces_at_shutdown(w):
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
        if w.rank == 0:
            assert "did not shut the policy down" in str(e) or "did not finish" in str(e), str(e)
    else:
        raise AssertionError("shutting down with a dead peer must raise")


if __name__ == "__main__":
    main()
