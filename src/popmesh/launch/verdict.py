"""Decide how a launch ended: which rank failed first (the root cause) and which were torn down.

A rank counts as failed if it exited non-zero before the launcher began tearing down, or if its
error record is older than the teardown (it failed on its own, at about the same time). Of the
failed ranks the root cause is the one that failed first: by its error record's time, else by
the time its exit was seen. Under MPI a rank's exit code is its own, from its exit note, where it left
one: mpiexec's status mixes every process's (Hydra ORs them), the teardown's signal included.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
from collections.abc import Sequence

from popmesh.launch.errorfile import ErrorRecord, read_error_file
from popmesh.launch.output import OutputPump
from popmesh.launch.plan import error_file_name
from popmesh.launch.rankwatch import RankEnd, RankExit
from popmesh.launch.result import LaunchResult, RankFailure, exit_status
from popmesh.launch.runner import Child

__all__ = ["judge_local", "judge_mpi", "ended_together"]

# Ranks whose ends the watch saw this close together cannot be ordered unless their end pipes ordered them:
# Hydra kills the other ranks the moment one dies, and their pidfds become ready with the first one's
# (by pidfds alone, rank 1 of 3 killed on a 2-core box: 30 runs of 30 fell within this window).
TOGETHER_S = 0.01


def _interrupted_code(received: int | None) -> int:
    return 0 if received is None else 128 + received


def _signal_name(received: int | None) -> str | None:
    return None if received is None else signal.Signals(received).name


def judge_local(
    children: Sequence[Child], *, error_dir: str, pump: OutputPump, teardown_at: float | None,
    received: int | None, world_size: int, engine: str, restarts: Sequence[str] = (),
) -> LaunchResult:
    """The result of a launch whose children are the ranks themselves (torch and jax engines); a child
    that a restarted process replaced is not a failure of the launch (``restarts`` tells of it)."""
    timed: list[tuple[float, int, RankFailure]] = []
    terminated: list[int] = []
    for child in children:
        assert child.rank is not None and child.returncode is not None
        if child.returncode == 0 or child.replaced:
            continue
        record = read_error_file(os.path.join(error_dir, error_file_name(child.rank)))
        own = not child.signalled or (record is not None and teardown_at is not None and record.time < teardown_at)
        if not own:
            terminated.append(child.rank)
            continue
        code, sig = exit_status(child.returncode)
        host = record.host if record is not None else socket.gethostname()  # this launcher's ranks run here
        failure = RankFailure(child.rank, code, sig, record, tuple(pump.tail(child.rank)), host)
        timed.append((record.time if record else child.exited_at or 0.0, child.rank, failure))
    failures = _causes_first(timed)
    return LaunchResult(
        returncode=failures[0].exitcode if failures else _interrupted_code(received),
        world_size=world_size,
        engine=engine,
        failure=failures[0] if failures else None,
        other_failures=tuple(failures[1:]),
        terminated=tuple(sorted(terminated)),
        interrupted_by=_signal_name(received),
        restarts=tuple(restarts),
    )


def _causes_first(timed: list[tuple[float, int, RankFailure]]) -> list[RankFailure]:
    """The failures, earliest first, except that a rank whose error names a failed peer as its cause comes
    after every failure that names none: a rank killed outright is only seen to end when the launcher reaps
    it, which under load can be after its peer recorded the loss. Pure."""
    failed = {rank for _, rank, _ in timed}

    def consequence(failure: RankFailure) -> bool:
        return failure.error is not None and bool(set(failure.error.peers) & (failed - {failure.rank}))

    return [failure for _, _, failure in sorted(timed, key=lambda item: (consequence(item[2]), item[0], item[1]))]


def _records(error_dir: str) -> list[ErrorRecord]:
    found = (read_error_file(path) for path in glob.glob(os.path.join(error_dir, error_file_name("*"))))
    return sorted((r for r in found if r is not None), key=lambda r: (r.time, r.rank))


def judge_mpi(
    child: Child, *, error_dir: str, pump: OutputPump, teardown_at: float | None, received: int | None,
    world_size: int, killed: Sequence[RankEnd] = (), exits: Sequence[RankExit] = (), requested: bool = False,
) -> LaunchResult:
    """The result of an mpiexec run: ranks are named by their error records and their exit notes with a
    non-zero status (``exits``: each rank's own exit code), else by the watch of this host's ranks
    (``killed``: processes that ended without an exit note, earliest first), else mpiexec is blamed.
    ``requested``: the launcher ended the job itself, for a rank's exit note (mpiexec's status is then the
    teardown's); this host's ranks that ended without an exit note are listed as torn down."""
    assert child.returncode is not None
    signalled = requested or received is not None  # mpiexec's status is not the job's own
    failures = _own_failures(child.returncode, error_dir, pump, teardown_at, exits, signalled)
    if child.returncode == 0 and not failures:
        return LaunchResult(0, world_size, "mpi")
    terminated: tuple[int, ...] = ()
    hints: tuple[str, ...] = ()
    if failures and requested and received is None:
        named = {f.rank for f in failures}
        terminated = tuple(sorted(end.rank for end in killed if end.rank not in named))
    if not failures and received is None and killed:
        # No record: the first rank of this host seen to end without an exit note was killed; mpiexec's
        # status is the first failed process's (Hydra reports a signal N as N).
        first, *rest = killed
        code = exit_status(child.returncode)[0]
        sig = _signal_of(code)
        failures = [RankFailure(first.rank, 128 + code if sig else code, sig, None, tuple(pump.tail(first.rank)),
                                first.host)]
        terminated = tuple(sorted(end.rank for end in rest))
        together = ended_together(killed)
        if len(together) > 1:
            hints = (f"ranks {', '.join(map(str, together))} were seen to end together (within "
                     f"{TOGETHER_S * 1000:g} ms: Hydra kills the other ranks the moment one dies), so the first of "
                     "them to die cannot be told; the root cause is a guess",)
    if not failures and received is None:
        code, sig = exit_status(child.returncode)
        said = pump.tail(None, "stdout") + pump.tail(None, "stderr")
        # A rank of another host killed by a signal leaves no record here, and hydra's "BAD TERMINATION"
        # banner names the first of the processes its cleanup killed, not the first to die: mpiexec is blamed.
        failures = [RankFailure(None, code, sig, None, tuple(said))]
    return LaunchResult(
        returncode=failures[0].exitcode if failures else _interrupted_code(received) or 1,
        world_size=world_size,
        engine="mpi",
        failure=failures[0] if failures else None,
        other_failures=tuple(failures[1:]),
        terminated=terminated,
        interrupted_by=_signal_name(received),
        hints=hints,
    )


def _own_failures(
    returncode: int, error_dir: str, pump: OutputPump, teardown_at: float | None, exits: Sequence[RankExit],
    signalled: bool,
) -> list[RankFailure]:
    """The ranks that failed on their own, before any teardown, earliest first: each error record, and each
    exit note with a non-zero status (a rank that left no record: ``sys.exit(2)`` before MPI started). A
    rank's code is its exit note's; without one (it aborted the MPI job), the first rank's is mpiexec's
    ``returncode`` (the code the job was aborted with) unless the launcher ``signalled`` mpiexec, else 1."""
    before = [r for r in _records(error_dir) if teardown_at is None or r.time < teardown_at]
    noted = {e.rank: e for e in exits}
    recorded = {r.rank for r in before}
    failed = [e for e in exits
              if e.status != 0 and e.rank not in recorded and (teardown_at is None or e.time < teardown_at)]
    timed: list[tuple[float, int, ErrorRecord | RankExit]] = sorted(
        [(r.time, r.rank, r) for r in before] + [(e.time, e.rank, e) for e in failed], key=lambda item: item[:2])
    aborted = exit_status(returncode)[0] if returncode > 0 and not signalled else 1
    failures = []
    for i, (_, rank, what) in enumerate(timed):
        note = noted.get(rank)
        code = note.status if note is not None else aborted if i == 0 else 1
        error = what if isinstance(what, ErrorRecord) else None
        failures.append(RankFailure(rank, code, None, error, tuple(pump.tail(rank)), what.host))
    return failures


def ended_together(killed: Sequence[RankEnd], window: float = TOGETHER_S) -> list[int]:
    """The ranks of ``killed`` (earliest first) whose end was seen within ``window`` seconds of the first:
    the first of them to die cannot be told. Empty where every end has its place in the kernel's order
    (:attr:`RankEnd.order`, from the ranks' end pipes): that order is exact. Pure."""
    if all(end.order is not None for end in killed):
        return []
    return [end.rank for end in killed if end.time - killed[0].time <= window]


def _signal_of(code: int) -> str | None:
    """The signal Hydra's exit status ``code`` stands for (it exits with N for a process killed by signal N)."""
    try:
        return signal.Signals(code).name if 0 < code < 64 else None
    except ValueError:
        return None
