"""The launcher's watch of MPI ranks orders their ends as it sees them, and never orders ends it cannot see."""

import os
import subprocess
import sys
import time

import pytest

from popmesh.launch.bootstrap import END_PIPE, EXIT_NOTE, HELD_NOTE, PID_NOTE, WATCHED_NOTE
from popmesh.launch.rankwatch import RankEnd, RankWatch, earliest_first, releases_highest_first

HOST = "testhost"
# A rank's bootstrap as far as the watch sees it: it waits to be watched, holding its end pipe, then lives on.
_RANK = """
import sys, time
from popmesh.launch.bootstrap import _await_watch
_await_watch(*sys.argv[1:4])
time.sleep(60)
"""


def _note(directory, rank, pid):
    (directory / f"rank-{rank}{PID_NOTE}").write_text(f"{pid} {HOST}")


def _rank(directory, rank, env=None):
    """A process that waits to be watched as rank ``rank`` of ``directory``, holding its end pipe."""
    notes = [str(directory / f"rank-{rank}{suffix}") for suffix in (WATCHED_NOTE, END_PIPE, HELD_NOTE)]
    proc = subprocess.Popen([sys.executable, "-c", _RANK, *notes], env={**os.environ, **(env or {})})
    _note(directory, rank, proc.pid)
    return proc


def _wait_watched(directory, *ranks):
    deadline = time.monotonic() + 10
    while not all((directory / f"rank-{r}{WATCHED_NOTE}").exists() for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all((directory / f"rank-{r}{WATCHED_NOTE}").exists() for r in ranks)


def _ended_process() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_ranks_already_gone_when_adopted_share_one_time_and_a_rank_seen_ending_later_comes_after(tmp_path):
    """Ranks that ended before the watch adopted them cannot be ordered: they share the wake-up's time (the
    judge then says the root cause is a guess) instead of being ordered by file name."""
    for rank in (2, 1):
        _note(tmp_path, rank, _ended_process())
    alive = _rank(tmp_path, 0)
    with RankWatch(str(tmp_path), HOST) as watch:
        _wait_watched(tmp_path, 0)
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


def test_ends_every_end_pipe_ordered_are_never_together_and_come_in_that_order():
    from popmesh.launch.verdict import ended_together

    ends = [RankEnd(2, 12, HOST, 100.0, order=1), RankEnd(1, 11, HOST, 100.0, order=0),
            RankEnd(0, 10, HOST, 99.0, order=2)]
    assert [e.rank for e in earliest_first(ends)] == [1, 2, 0]  # the kernel's order, not the times seen
    assert ended_together(earliest_first(ends)) == []
    mixed = [*ends[:2], RankEnd(0, 10, HOST, 99.0)]  # one end without a place: by the times seen
    assert [e.rank for e in earliest_first(mixed)] == [0, 1, 2] and ended_together(earliest_first(mixed)) == [0]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not releases_highest_first(), reason="this kernel does not release a dying process's files "
                    "highest number first: end pipes are not used")
def test_ranks_hold_their_end_pipe_above_the_pmi_socket_and_their_ends_come_in_the_order_they_died(tmp_path):
    """Each rank holds the only writer of its end pipe at a descriptor above ``PMI_FD`` (moved there when
    the first free number is not), and the watch orders the ranks' ends by the pipes: the kernel's order."""
    ranks = {r: _rank(tmp_path, r, {"PMI_FD": "40"}) for r in (0, 1, 2)}
    with RankWatch(str(tmp_path), HOST) as watch:
        _wait_watched(tmp_path, 0, 1, 2)
        for r, proc in ranks.items():
            fds = {int(fd): os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")}
            held = [fd for fd, target in fds.items() if target.endswith(f"rank-{r}{END_PIPE}")]
            assert len(held) == 1 and held[0] > 40, fds
        for r in (2, 0, 1):
            ranks[r].kill()
            ranks[r].wait()
        time.sleep(0.2)
    ends = watch.killed()
    assert [e.rank for e in ends] == [2, 0, 1] and [e.order for e in ends] == [0, 1, 2], ends
