"""The launcher's watch of MPI ranks orders their ends as it sees them, and never orders ends it cannot see."""

import os
import subprocess
import sys
import time

from popmesh.launch.bootstrap import EXIT_NOTE, PID_NOTE
from popmesh.launch.rankwatch import RankWatch

HOST = "testhost"


def _note(directory, rank, pid):
    (directory / f"rank-{rank}{PID_NOTE}").write_text(f"{pid} {HOST}")


def _ended_process() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_ranks_already_gone_when_adopted_share_one_time_and_a_rank_seen_ending_later_comes_after(tmp_path):
    """Ranks that ended before the watch adopted them cannot be ordered: they share the wake-up's time (the
    judge then says the root cause is a guess) instead of being ordered by file name."""
    for rank in (2, 1):
        _note(tmp_path, rank, _ended_process())
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    _note(tmp_path, 0, alive.pid)
    with RankWatch(str(tmp_path), HOST) as watch:
        deadline = time.monotonic() + 10
        while not (tmp_path / "rank-0.watched").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        alive.kill()
        alive.wait()
        time.sleep(0.3)
    ends = watch.killed()
    assert [e.rank for e in ends] == [1, 2, 0], ends  # by (time, rank): 1 and 2 together, then 0
    assert ends[0].time == ends[1].time < ends[2].time, ends


def test_a_rank_with_an_exit_note_is_not_counted_killed(tmp_path):
    pid = _ended_process()
    _note(tmp_path, 0, pid)
    (tmp_path / f"rank-0{EXIT_NOTE}").write_text("0")
    with RankWatch(str(tmp_path), HOST) as watch:
        time.sleep(0.1)
    assert watch.killed() == [] and os.path.exists(tmp_path / "rank-0.watched")


def test_ends_seen_within_the_window_of_the_first_cannot_be_ordered():
    from popmesh.launch.rankwatch import RankEnd
    from popmesh.launch.verdict import TOGETHER_S, ended_together

    ends = [RankEnd(2, 12, HOST, 100.0), RankEnd(1, 11, HOST, 100.0006), RankEnd(0, 10, HOST, 100.0 + 2 * TOGETHER_S)]
    assert ended_together(ends) == [2, 1]  # the kernel showed rank 2's end first: 1 may have died before it
    assert ended_together(ends[:1]) == [2] and ended_together([]) == []
