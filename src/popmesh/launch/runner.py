"""Spawn, watch and tear down the processes of one launch.

Every child starts in its own session (its own process group), with a parent-death signal set by
the bootstrap, so the whole group can be killed at teardown and nothing outlives a SIGKILLed
launcher. Exits are noticed at once through pidfds (polling where the kernel lacks them).

When a child fails (non-zero exit or a signal), it is first offered to ``restart`` (``--max-restarts``):
a replacement process takes its place and the others run on. Otherwise, or when the launcher receives
SIGINT/SIGTERM, or when a watch of processes the launcher did not start asks for it
(:meth:`Supervisor.request_teardown`: an MPI rank failed where mpiexec does not act), every live group
gets SIGTERM (or the received signal), then SIGKILL after ``grace`` seconds; a second signal to the
launcher skips the grace period.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from popmesh.launch.output import OutputPump
from popmesh.launch.preload import ForkedProcess, ForkServer

__all__ = ["Child", "Supervisor", "reap_group"]

_POLL_S = 0.05
_FORWARDED = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Child:
    """One spawned process: a rank, or (``rank=None``) the mpiexec that runs all ranks."""

    rank: int | None
    proc: subprocess.Popen[bytes] | ForkedProcess
    pidfd: int | None = None
    returncode: int | None = None
    exited_at: float | None = None  # wall clock, comparable with error records
    signalled: bool = False  # the launcher sent it a teardown signal before it exited
    replaced: bool = False  # it failed and a restarted process took its rank
    left: bool = False  # it failed with no restart left in an elastic world, which went on without it


class Supervisor:
    """Owns the children of one launch until every one of them has been reaped."""

    def __init__(
        self, pump: OutputPump, grace: float, restart: Callable[[Child], Child | None] | None = None,
        forks: ForkServer | None = None,
    ) -> None:
        self.children: list[Child] = []
        self.forks = forks  # --preload: ranks are forked by this server instead of started
        self._restart = restart  # given a failed child, spawns its replacement (None: no budget left)
        self._sel: selectors.BaseSelector | None = None
        self.teardown_at: float | None = None
        self.received: int | None = None
        self.requested = False  # request_teardown() was called
        self._pump = pump
        self._grace = grace
        self._kill_deadline: float | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def set_restart(self, restart: Callable[[Child], Child | None]) -> None:
        """Offer every failed child to ``restart`` first: it spawns a replacement, or returns None (having
        marked the child ``left`` where the world goes on without it)."""
        self._restart = restart

    def spawn(
        self, cmd: Sequence[str], env: Mapping[str, str], rank: int | None, pass_fds: Sequence[int] = (),
        *, inherit_output: bool = False,
    ) -> Child:
        """Start ``cmd`` in a new session with piped stdout/stderr (stdin only for rank 0).

        ``inherit_output`` gives the child this process's stdout/stderr unprefixed (a live terminal
        view on rank 0); its traceback still reaches the summary through its error file.
        """
        proc: subprocess.Popen[bytes] | ForkedProcess
        piped = None if inherit_output else subprocess.PIPE
        stdin = None if rank in (0, None) else subprocess.DEVNULL
        if self.forks is not None:
            proc = self.forks.popen(cmd, env, stdin=stdin, stdout=piped, stderr=piped, pass_fds=pass_fds)
        else:
            proc = subprocess.Popen(list(cmd), env=dict(env), stdin=stdin, stdout=piped, stderr=piped,
                                    start_new_session=True, pass_fds=tuple(pass_fds))
        child = Child(rank=rank, proc=proc, pidfd=_pidfd(proc.pid))
        self.children.append(child)
        if proc.stdout is not None and proc.stderr is not None:
            self._pump.attach(proc.stdout, "stdout", rank)
            self._pump.attach(proc.stderr, "stderr", rank)
        return child

    def watch(self) -> None:
        """Block until every child has exited, tearing the rest down after the first failure."""
        with self._forward_signals(), selectors.DefaultSelector() as sel:
            self._sel = sel
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            for child in self.children:
                if child.pidfd is not None:
                    sel.register(child.pidfd, selectors.EVENT_READ, child)
            while self._live():
                for key, _ in sel.select(self._timeout()):
                    if key.data is None:
                        _drain(self._wake_r)
                for child in self._live():
                    if _has_exited(child.proc.pid):
                        self._reap(child, sel)
                        self._offer_restart(child)
                self._step()
            self._sel = None
        self._pump.join()

    def _offer_restart(self, child: Child) -> None:
        """A failed rank's replacement, while the world is not being torn down and the budget allows."""
        if child.returncode == 0 or self._restart is None or self.teardown_at is not None or self.received is not None:
            return
        fresh = self._restart(child)
        if fresh is None:
            return
        child.replaced = True
        if fresh.pidfd is not None and self._sel is not None:
            self._sel.register(fresh.pidfd, selectors.EVENT_READ, fresh)

    def request_teardown(self) -> None:
        """Tear the children down as after a failure (callable from any thread): a rank failed that only
        a watch of the ranks sees, such as an MPI rank under mpiexec."""
        self.requested = True
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def kill_all(self) -> None:
        """Emergency stop (a spawn failed half-way, or the caller was interrupted): SIGKILL and reap."""
        for child in self._live():
            _killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
            child.returncode = child.proc.returncode

    def close(self) -> None:
        """Release the wake-up pipe and any pidfds left open (once: fd numbers get reused)."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._wake_r, self._wake_w, *(c.pidfd for c in self.children if c.pidfd is not None)):
            with contextlib.suppress(OSError):
                os.close(fd)
        for child in self.children:
            child.pidfd = None
        if self.forks is not None:
            for child in self.children:
                reap_group(child.proc.pid)
            self.forks.close()
            self.forks = None

    def _live(self) -> list[Child]:
        return [c for c in self.children if c.returncode is None]

    def _timeout(self) -> float | None:
        if any(c.pidfd is None for c in self._live()):
            return _POLL_S
        if self._kill_deadline is not None:
            return max(0.0, self._kill_deadline - time.monotonic())
        return None

    def _reap(self, child: Child, sel: selectors.BaseSelector) -> None:
        """Record the exit; kill what the child left in its group while its pid still pins the group."""
        _killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        child.returncode = child.proc.returncode
        child.exited_at = time.time()
        if self.forks is not None:  # this process adopts the group's orphans while it forks ranks
            reap_group(child.proc.pid)
        if child.pidfd is not None:
            sel.unregister(child.pidfd)
            os.close(child.pidfd)
            child.pidfd = None

    def _step(self) -> None:
        """Start teardown on the first failure or signal; escalate to SIGKILL after the grace period."""
        if self.teardown_at is None:
            failed = any(c.returncode not in (None, 0) and not c.replaced and not c.left for c in self.children)
            if self.received is not None or failed or self.requested:
                sig = self.received if self.received is not None else signal.SIGTERM
                self.teardown_at = time.time()
                self._kill_deadline = time.monotonic() + self._grace
                self._signal_live(sig)
        if self._kill_deadline is not None and time.monotonic() >= self._kill_deadline:
            self._signal_live(signal.SIGKILL)
            self._kill_deadline = None

    def _signal_live(self, sig: int) -> None:
        for child in self._live():
            child.signalled = True
            _killpg(child.proc.pid, sig)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.received is not None:  # second signal: no more grace
            self._kill_deadline = time.monotonic()
        self.received = signum if self.received is None else self.received
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    @contextlib.contextmanager
    def _forward_signals(self) -> Iterator[None]:
        """Catch SIGINT/SIGTERM while watching (only possible in the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _FORWARDED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it exits), or None where unsupported."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_exited(pid: int) -> bool:
    """True once ``pid`` is a zombie; it is not reaped, so its pid and group stay reserved."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None and info.si_pid != 0


def reap_group(pgid: int) -> None:
    """Reap the exited children of ours in process group ``pgid`` (a rank's orphans we adopted)."""
    with contextlib.suppress(ChildProcessError):
        while (info := os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG)) is not None and info.si_pid:
            pass


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        os.set_blocking(fd, False)
        os.read(fd, 4096)
