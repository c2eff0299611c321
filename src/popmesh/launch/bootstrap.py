"""Per-rank entry point: run the user's script or module the way ``python`` would, and report failure.

``python -P .../popmesh/launch/bootstrap.py [-m] TARGET [ARGS...]`` is what the launcher starts on
every rank (directly, or under mpiexec); ``python -m popmesh.launch.bootstrap ...`` works too, e.g.
in a hand-written mpiexec line. The launcher runs it by path because this file needs only the
standard library until something fails: a rank does not pay for importing the popmesh package
(numpy and friends) before the user's own code decides what it needs. It

* ties the rank's life to the launcher (``POPMESH_PARENT_PID`` → ``PR_SET_PDEATHSIG``; Linux),
* makes stdout line-buffered so every line reaches the launcher whole and promptly, and lets a
  forwarded SIGINT raise KeyboardInterrupt,
* runs TARGET as ``__main__`` (a path like ``python script.py``; with ``-m`` a module like
  ``python -m``), with ``sys.argv = [TARGET, *ARGS]``,
* on an uncaught exception prints the traceback, writes the error record to
  ``POPMESH_ERROR_FILE`` (torchrun's ``@record`` idea) and, if MPI is up, aborts the whole MPI job
  so that peers blocked in a collective do not hang; the rank then exits with status 1,
* under ``popmesh launch --engine mpi`` (whose ranks mpiexec starts, so the launcher does not know
  their pids) leaves two notes beside the error record: ``rank-R.pid`` (pid and host) when it starts
  and ``rank-R.exit`` (the exit status and the time) when it exits normally, so that the launcher, which
  watches the pids, can tell a rank that was killed (no exit note, no error record) and name it, and can
  end the job when a rank exits with a non-zero status that Hydra does not act on (before the rank
  initialised MPI); and it holds its end pipe (``rank-R.end``), whose end tells the launcher exactly
  which rank died first.

``bootstrap.py --leash SIGNUM PARENT_PID CMD ARGS...`` sets the parent-death signal and execs CMD
(the setting survives exec): the launcher puts mpiexec on this leash.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

__all__ = ["main", "run", "set_parent_death_signal", "die_with_parent"]

_USAGE = "usage: bootstrap.py [-m] TARGET [ARGS...]  |  bootstrap.py --leash SIGNUM PARENT_PID CMD [ARGS...]"
_SKIP_FILES = (os.path.abspath(__file__), runpy.__file__, "<frozen runpy>")
_EXIT_WATCHDOG_S = 5.0  # after a failure, exit even if a non-daemon thread or atexit hook hangs
_PR_SET_PDEATHSIG = 1
PID_NOTE = ".pid"  # beside the error record rank-R.json: "PID HOST" once the rank runs
WATCHED_NOTE = ".watched"  # the launcher's answer: it holds a pidfd of this rank (or cannot watch it)
EXIT_NOTE = ".exit"  # "STATUS TIME" once it exits normally (TIME: the wall clock, as in the error record)
END_PIPE = ".end"  # a FIFO the launcher reads; the rank holds its only writer, so its end shows there
HELD_NOTE = ".held"  # the rank holds its end pipe (the launcher then reads it, and answers "watched")
_WATCH_WAIT_S = 5.0  # how long a rank waits for that answer before it runs unwatched (on a loaded box 1 s is too
# short: a killed rank goes unwatched, and the rank Hydra kills after it is named the root cause)
_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # only here: it costs import time and only Linux needs it

    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Set the parent-death signal; exit at once if the parent died before it was set."""
    set_parent_death_signal(sig)
    if os.getppid() != expected_parent:
        os._exit(128 + int(sig))


def _line_buffered() -> None:
    """One write per line: the launcher (or mpiexec) then prefixes whole lines."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def _interruptible() -> None:
    """Let a forwarded SIGINT raise KeyboardInterrupt even if a shell started us with it ignored.

    A rank lives in its own session, so only the launcher can send it SIGINT, and that should stop it.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _mpi_running() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized()) and not mpi.Is_finalized()


def _mpi_abort(code: int) -> None:
    """Abort the MPI job if this rank has initialised MPI (and not yet finalised it)."""
    if not _mpi_running():
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)


def _report(exc: BaseException, *, quiet: bool = False) -> None:
    """Print the traceback like Python does (unless ``quiet``) and write the error record, if the
    launcher asked for one."""
    try:
        from popmesh.launch import errorfile
    except Exception:
        import traceback

        traceback.print_exception(exc)
        return
    record = errorfile.make_record(exc, _SKIP_FILES)
    if not quiet:
        sys.stderr.write(record.traceback)
        sys.stderr.flush()
    path = errorfile.error_file_path()
    if path:
        try:
            errorfile.write_error_file(record, path)
        except OSError as err:
            sys.stderr.write(f"popmesh bootstrap: could not write error file {path}: {err}\n")


def _exit_soon(code: int) -> None:
    """Start a daemon watchdog that hard-exits with ``code`` if normal shutdown stalls, saying so (a
    stalled exit is a defect of whatever stalled it: the message lets it be seen)."""
    timer = threading.Timer(_EXIT_WATCHDOG_S, _exit_now, args=(code,))
    timer.daemon = True
    timer.start()


def _exit_now(code: int) -> None:
    stalled = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
    try:
        os.write(2, (f"popmesh: this rank's exit stalled {_EXIT_WATCHDOG_S:g} s after its failure (in an atexit "
                     f"hook, or non-daemon threads {stalled or 'none'}); exiting now\n").encode())
    finally:
        os._exit(code)


def _set_path(entry: str) -> None:
    """Put ``entry`` first on sys.path as python would (under ``-P`` nothing is there to replace)."""
    if sys.flags.safe_path:
        sys.path.insert(0, entry)
    else:
        sys.path[0] = entry


def run(target: str, args: list[str], *, module: bool = False) -> int:
    """Run ``target`` as ``__main__``; return its exit status (1 after an uncaught exception)."""
    sys.argv = [target, *args]
    try:
        if module:
            _set_path(os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            _set_path(os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0) and _mpi_running():
            _report(exc, quiet=True)  # the launcher names this rank (mpiexec would only give its exit code)
            _mpi_abort(exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException as exc:
        _report(exc)
        _mpi_abort(1)
        _exit_soon(1)
        return 1
    return 0


def _leash(argv: list[str]) -> None:
    """``SIGNUM PARENT_PID CMD ARGS...``: die with the parent, as CMD."""
    if len(argv) < 3:
        sys.exit(_USAGE)
    die_with_parent(int(argv[1]), int(argv[0]))
    os.execvp(argv[2], argv[2:])


def note_path(error_file_template: str, rank: int | str, suffix: str) -> str:
    """The note ``suffix`` of ``rank`` beside its error record (the launcher's template, ``{rank}`` inside)."""
    return os.path.splitext(error_file_template.replace("{rank}", str(rank)))[0] + suffix


def _mpi_notes() -> str | None:
    """Leave this MPI rank's pid note; the exit note's path (None when not under ``--engine mpi``)."""
    template = os.environ.get("POPMESH_ERROR_FILE")
    rank = next((os.environ[v] for v in _MPI_RANK_VARS if os.environ.get(v, "").isdigit()), None)
    if os.environ.get("POPMESH_ENGINE") != "mpi" or not template or rank is None:
        return None
    if _write_note(note_path(template, rank, PID_NOTE), f"{os.getpid()} {os.uname().nodename}"):
        _await_watch(note_path(template, rank, WATCHED_NOTE), note_path(template, rank, END_PIPE),
                     note_path(template, rank, HELD_NOTE))
    return note_path(template, rank, EXIT_NOTE)


def _await_watch(watched: str, end_pipe: str, held: str) -> None:
    """Run the user's code only once the launcher watches this process: a rank killed before that would
    be found already gone, with no telling when, and could not be told from the ranks torn down after it.
    Meanwhile hold this rank's end pipe once the launcher has made it, and say so (``held``): the
    launcher starts reading it only then, and says ``watched`` after."""
    deadline = time.monotonic() + _WATCH_WAIT_S
    holding = False
    while not os.path.exists(watched) and time.monotonic() < deadline:
        if not holding and _hold_end_pipe(end_pipe):
            holding = _write_note(held, "")
        time.sleep(0.002)


def _hold_end_pipe(path: str) -> bool:
    """Hold the only writer of this rank's end pipe (False: no pipe, or nobody reads it yet), at a
    descriptor number above Hydra's PMI socket (``PMI_FD``): a dying process's files are released
    highest number first, so the launcher sees this rank's end before Hydra sees the PMI socket close
    and kills the other ranks."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    pmi = os.environ.get("PMI_FD", "")
    if pmi.isdigit() and fd <= int(pmi):
        import fcntl  # only here, as ctypes above

        try:
            fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, int(pmi) + 1)  # kept open: the rank's end closes it
        except OSError:  # no number above it is free: this pipe cannot order the rank's end, and says so
            os.write(fd, b"?")  # (the launcher drops a pipe with data in it)
            return True
        os.close(fd)
    return True


def _write_note(path: str, text: str) -> bool:
    """Write a note whole (the launcher never reads half of one); False where the folder is not there
    (a rank on another host without a shared file system: nobody reads it there)."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(path + ".tmp", path)
    except OSError:
        return False
    return True


def _status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives."""
    return 0 if code is None else code if isinstance(code, int) else 1


def main(argv: list[str] | None = None) -> None:
    """Entry of ``bootstrap.py`` / ``python -m popmesh.launch.bootstrap``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--leash"]:
        _leash(argv[1:])
    parent = os.environ.pop("POPMESH_PARENT_PID", None)
    if parent:
        die_with_parent(int(parent))
    module = argv[:1] == ["-m"]
    rest = argv[1:] if module or argv[:1] == ["--"] else argv
    if not rest:
        sys.exit(_USAGE)
    _line_buffered()
    _interruptible()
    exit_note = _mpi_notes()
    status = 1
    try:
        status = run(rest[0], rest[1:], module=module)
    except SystemExit as exc:
        status = _status(exc.code)
        raise
    finally:
        if exit_note is not None:
            _write_note(exit_note, f"{status} {time.time():.6f}")
    sys.exit(status)


if __name__ == "__main__":
    main()
