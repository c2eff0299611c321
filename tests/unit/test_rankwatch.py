"""The launcher's watch of MPI ranks orders their ends as it sees them, and never orders ends it cannot see;
an exit with a non-zero status, which Hydra does not act on, ends the job, and the judge names that rank with
its own exit code."""

import os
import subprocess
import sys
import time

import pytest

from popmesh.launch.bootstrap import END_PIPE, EXIT_NOTE, HELD_NOTE, PID_NOTE, WATCHED_NOTE
from popmesh.launch.rankwatch import (
    RankEnd,
    RankExit,
    RankWatch,
    earliest_first,
    ends_the_job,
    read_exit_note,
    releases_highest_first,
)

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


def test_only_an_exit_note_with_a_non_zero_status_ends_the_job_and_the_earliest_is_named():
    """Hydra ends the job itself for a signal or an MPI abort (no exit note), never for an exit code."""
    assert ends_the_job([]) is None
    assert ends_the_job([RankExit(0, 0, 1.0), RankExit(2, 0, 2.0)]) is None
    failed = [RankExit(0, 0, 1.0), RankExit(2, 1, 3.0), RankExit(3, 2, 2.5), RankExit(1, 2, 2.5)]
    assert ends_the_job(failed) == RankExit(1, 2, 2.5)  # the earliest; of those at one time, the lowest rank


def test_an_exit_note_gives_its_status_and_time_and_a_bare_status_is_timed_by_its_file(tmp_path):
    note = tmp_path / f"rank-1{EXIT_NOTE}"
    note.write_text("2 1700000000.250000\n")
    assert read_exit_note(str(note), 1, HOST) == RankExit(1, 2, 1700000000.25, HOST)
    note.write_text("3\n")
    assert read_exit_note(str(note), 1) == RankExit(1, 3, os.stat(note).st_mtime)
    note.write_text("")
    assert read_exit_note(str(note), 1) is None and read_exit_note(str(tmp_path / "none"), 1) is None


def test_the_watch_tells_the_launcher_once_when_a_rank_exits_non_zero_on_any_host(tmp_path):
    """A rank of another host (its pid note names that host, so it has no pidfd here) is seen by its exit
    note alone; the watch calls ``on_failure`` once, from its thread, with that rank's exit."""
    told: list[RankExit] = []
    (tmp_path / f"rank-0{PID_NOTE}").write_text("4242 otherhost")
    (tmp_path / f"rank-1{EXIT_NOTE}").write_text("0 98.5")
    with RankWatch(str(tmp_path), HOST, on_failure=told.append) as watch:
        time.sleep(0.1)
        assert told == []  # a zero status ends nothing
        (tmp_path / f"rank-0{EXIT_NOTE}").write_text("2 100.0")
        deadline = time.monotonic() + 5
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / f"rank-1{EXIT_NOTE}").write_text("5 99.0")  # read once: a note is written whole, once
        time.sleep(0.1)
    assert told == [RankExit(0, 2, 100.0, "otherhost")]
    assert watch.exits() == [RankExit(0, 2, 100.0, "otherhost"), RankExit(1, 0, 98.5, "")]


def _judge(tmp_path, returncode, *, teardown_at, requested, exits=(), killed=(), records=()):
    from popmesh.launch.errorfile import ErrorRecord, write_error_file
    from popmesh.launch.output import OutputPump
    from popmesh.launch.runner import Child
    from popmesh.launch.verdict import judge_mpi

    for rank, kind, message, when in records:
        write_error_file(ErrorRecord(rank, kind, message, f"{kind}: {message}\n", when, 10 + rank, HOST),
                         str(tmp_path / f"rank-{rank}.json"))
    mpiexec = Child(rank=None, proc=None, returncode=returncode)  # type: ignore[arg-type]
    return judge_mpi(mpiexec, error_dir=str(tmp_path), pump=OutputPump(sys.stdout, sys.stderr),
                     teardown_at=teardown_at, received=None, world_size=3, killed=list(killed), exits=list(exits),
                     requested=requested)


def test_a_rank_the_launcher_ended_the_job_for_is_named_with_its_own_code_not_mpiexecs(tmp_path):
    """The launcher's SIGTERM makes mpiexec exit 15 (Hydra ORs every process's status): rank 1's exit note
    says 2, and the ranks Hydra then ended are listed as torn down."""
    killed = [RankEnd(0, 10, HOST, 101.0), RankEnd(2, 12, HOST, 101.0)]
    result = _judge(tmp_path, 15, teardown_at=100.5, requested=True, exits=[RankExit(1, 2, 100.0, HOST)],
                    killed=killed)
    assert result.returncode == 2 and result.failure is not None
    assert result.failure.describe() == f"rank 1 exited with code 2, on host {HOST}"
    assert result.terminated == (0, 2) and result.other_failures == ()


def test_a_recorded_failure_before_mpi_keeps_its_traceback_and_its_own_code(tmp_path):
    result = _judge(tmp_path, 15, teardown_at=100.5, requested=True,
                    exits=[RankExit(1, 1, 100.1, HOST), RankExit(0, 0, 100.2)],
                    records=[(1, "ModuleNotFoundError", "No module named 'x'", 100.0)])
    assert result.returncode == 1 and result.failure is not None and result.failure.error is not None
    assert result.failure.describe() == f"rank 1 exited with code 1 after raising ModuleNotFoundError: " \
                                        f"No module named 'x', on host {HOST}"


def test_exits_after_the_teardown_began_are_torn_down_and_an_abort_keeps_mpiexecs_code(tmp_path):
    late = _judge(tmp_path, 15, teardown_at=100.5, requested=True, exits=[RankExit(1, 2, 100.0), RankExit(0, 1, 100.7)])
    assert late.failure is not None and late.failure.rank == 1 and late.other_failures == ()
    (tmp_path / "abort").mkdir()  # rank 1 aborted the job (MPI_Abort(3)) before it could leave an exit note
    abort = _judge(tmp_path / "abort", 3, teardown_at=100.5, requested=False, records=[(1, "SystemExit", "3", 100.0)])
    assert abort.returncode == 3 and abort.failure is not None and abort.failure.exitcode == 3  # Hydra's: the abort
