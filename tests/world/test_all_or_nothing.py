"""A data-parallel step that fails because a rank was lost is applied by no rank: three ranks under
``popmesh launch --max-restarts 1``, rank 2 killed inside backward while GradientSync's buckets are
being reduced (tests/world/scripts/all_or_nothing.py). After the re-form and
``hand_over(applied=...)`` every rank holds the parameters and Adam state that every survivor had as
the failed step began, also when one survivor had applied that step (UNEVEN), and all end alike."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.world

SCRIPT = Path(__file__).resolve().parent / "scripts" / "all_or_nothing.py"
STEPS, KILL_AT = 12, 5


def _lines(out: str, kind: str) -> dict[int, list[str]]:
    """Each rank's ``KIND rank ...`` line (the launcher prefixes it with ``[rank R]``), by rank."""
    fields = (line.split("] ", 1)[-1].split() for line in out.splitlines())
    return {int(f[1]): f[2:] for f in fields if f and f[0] == kind}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("uneven", ["0", "1"], ids=["survivors-level", "one-survivor-applied-it"])
def test_the_step_a_lost_rank_broke_is_applied_by_no_rank(uneven):
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "3", "--max-restarts", "1", str(SCRIPT), str(STEPS),
           str(KILL_AT), uneven]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 2 was killed by SIGKILL" in done.stderr, done.stderr[-2000:]
    before, after, end = (_lines(done.stdout, kind) for kind in ("BEFORE", "AFTER", "DONE"))
    assert sorted(before) == [0, 1] and before[0] == before[1], done.stdout  # both survivors failed that step
    failed_step, state = int(before[0][0]), before[0][1]
    assert failed_step == KILL_AT, before
    assert sorted(after) == [0, 1, 2], done.stdout
    for rank, (step, digest) in after.items():  # everyone holds the state from before the failed step
        assert int(step) == KILL_AT and digest == state, (rank, after, before)
    assert sorted(end) == [0, 1, 2] and len({tuple(v) for v in end.values()}) == 1, end  # and ends alike
    assert end[0][0] == str(STEPS) and end[0][2] == "1", end
