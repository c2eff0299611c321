"""The background thread of an asynchronous policy, and what it shares with the main thread.

The main thread hands over weight snapshots and takes combined replacements under a lock, and
sends its metric row itself (one small point-to-point send on an internal tag). Everything else
happens in the background thread. Where the engine reports arrivals (gloo,
:func:`popmesh.comm.messages.on_arrival`), the thread sleeps until a message arrives, checking liveness
and reaping sends every :data:`_TOLD_IDLE_S` seconds. With more ranks than cores, every wake-up of
that thread takes the GIL and CPU from training: polling from 0.5 ms cost more than all its real
work, and waking it to send the metric row stalled the main thread for the whole wake-up (so the
main thread sends the row, ~20 us). Elsewhere (MPI) it polls, sleeping with a back-off between
5 ms and ``poll_interval`` when idle: a decision a few milliseconds later costs nothing, while a
poll costs ~0.1-0.2 ms of CPU when it runs cold between training steps. Starting the back-off at
5 ms instead of 2 ms took a 4-rank, 2-core MPI world from 7-10 polls per rank and decision to 5-7,
and the thread's CPU per decision from 12-14 ms to ~10 ms (in-situ thread clocks; 0.5 ms, the
first setting, cost more than the thread's real work).
Only a received message, a BYE sent or a finished replacement count as progress (a completed send
does not: it creates no follow-up work), so a completed send does not restart the back-off.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from popmesh.comm.messages import on_arrival
from popmesh.comm.world import World
from popmesh.core.errors import CommTimeout, PeerFailure, PopmeshError
from popmesh.population.mechanisms.asynchronous.coordinator import CoordinatorLink
from popmesh.population.mechanisms.asynchronous.deciders import Decider
from popmesh.population.mechanisms.asynchronous.protocol import BYE, METRIC, Channels
from popmesh.population.mechanisms.asynchronous.trainer import Pending, Snapshot, TrainerLink, reap

__all__ = ["Runtime", "surface"]

_MIN_PAUSE = 5e-3
_TOLD_IDLE_S = 0.25
_GRACE = 2.0


class Runtime:
    """One policy instance's background thread for the training ranks ``ranks`` (global);
    ``decider(n)`` makes the coordinator's decision protocol when this rank coordinates."""

    def __init__(self, world: World, ranks: Sequence[int], coordinator: int, tags: Channels,
                 decider: Callable[[int], Decider], timeout: float, poll_interval: float) -> None:
        self.timeout, self.poll_interval = timeout, poll_interval
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._abort = threading.Event()
        self.done = threading.Event()
        self._main_sends: list[Any] = []  # the main thread's metric sends (reaped by the main thread)
        self._snapshot: Snapshot | None = None
        self._pending: Pending | None = None
        self.error: BaseException | None = None
        self._shutdown_at: float | None = None
        self._shutdown_s = timeout
        self._bye_sent = False
        self._stop_watching = on_arrival(self._wake.set, group=world)
        self.trainer = TrainerLink(world, list(ranks), coordinator, tags, timeout, self.latest, self._deliver)
        self.coordinator = (CoordinatorLink(world, ranks, tags, decider(len(ranks)), timeout, local=self.trainer.handle)
                            if world.rank == coordinator else None)
        self._thread = threading.Thread(target=self._run, name=f"popmesh-population-{world.rank}", daemon=True)
        self._thread.start()

    # ---- main thread ---------------------------------------------------------------------------
    def post(self, snapshot: Snapshot, metric: float, fingerprint: int, steps: int, generation: int,
             objective: float = math.nan, hparams: Any = ()) -> None:
        """Hand over this cadence's snapshot, then send its report row (main thread): its metric, its
        experience (``steps``), how many replacements it applied (``generation``), the objective
        selection ranks by (NaN: the metric) and its encoded explored hyper-parameters."""
        with self._lock:
            self._snapshot = snapshot
        handle = self.trainer.isend_up(METRIC, snapshot.iteration, metric, fingerprint, steps, generation, objective,
                                       hparams)
        self._main_sends = reap(self._main_sends, self.timeout) + [handle]

    def quiet(self) -> bool:
        """Nothing for the main thread: no replacement waiting and no background error (lock-free
        reads of two references; a value set just after is seen at the next call)."""
        return self._pending is None and self.error is None

    def take_pending(self) -> Pending | None:
        """The replacement combined since the last call, if any (each is returned once)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def wait_round(self, iteration: int, timeout: float) -> None:
        """Block (main thread) until round ``iteration`` is resolved for this rank (the declared lag's
        wait); a background error is raised, and CommTimeout after ``timeout`` seconds."""
        deadline, pause = time.monotonic() + timeout, 2e-4
        while not self.trainer.round_resolved(iteration):
            surface(self.error)
            if self.done.is_set():
                raise PopmeshError("the asynchronous population policy stopped before its round "
                                   f"{iteration} was resolved")
            if time.monotonic() > deadline:
                raise CommTimeout(f"round {iteration} was not resolved within {timeout:g} s: waiting for "
                                  f"{self.trainer.waiting_for()} (the coordinator decides a round once every member "
                                  "reported it)", (self.trainer.coordinator,))
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)

    def request_shutdown(self, timeout: float) -> None:
        """Say BYE (after every queued metric) and keep serving until the coordinator's FIN; the
        coordinator gives up on missing ranks after ``timeout`` s, the others ``_GRACE`` s later
        (so they hear the coordinator's reason)."""
        with self._lock:
            if self._shutdown_at is None:
                self._shutdown_at, self._shutdown_s = time.monotonic(), float(timeout)
        self._wake.set()

    def join(self, timeout: float) -> None:
        """Wait for the thread to finish (``timeout`` plus grace for its own, more precise errors); if it
        still runs, stop it and raise CommTimeout saying what it waited for."""
        if not self.done.wait(timeout + 2 * _GRACE):
            waiting = self.waiting_for()
            self._abort.set()
            self._wake.set()
            self._thread.join(1.0)
            raise CommTimeout(f"the asynchronous population policy did not shut down within {timeout:g} s: "
                              f"still waiting for {waiting}. Every training rank must call shutdown() (or exit)")
        self._thread.join(1.0)

    def waiting_for(self) -> str:
        parts = [self.trainer.waiting_for()]
        if self.coordinator is not None and not self.coordinator.finished:
            parts.append(f"BYE from ranks {self.coordinator.missing_byes()}")
        return "; ".join(parts)

    # ---- background thread ---------------------------------------------------------------------
    def latest(self) -> Snapshot | None:
        with self._lock:
            return self._snapshot

    def _deliver(self, pending: Pending) -> None:
        with self._lock:
            self._pending = pending

    def _run(self) -> None:
        told = self._stop_watching is not None  # woken by arrivals and posts: no need to poll fast
        pause = _MIN_PAUSE
        try:
            while not self._abort.is_set():
                if told:
                    self._step()
                    pause = _TOLD_IDLE_S
                elif self._step():
                    pause = _MIN_PAUSE
                else:
                    pause = min(pause * 2, self.poll_interval)
                if self._finished():
                    self._drain()
                    break
                self._wake.wait(pause)
                self._wake.clear()
        except BaseException as e:
            self.error = e
            if self.coordinator is not None:
                self.coordinator.abort(f"{type(e).__name__}: {e}", e.ranks if isinstance(e, PeerFailure) else ())
        finally:
            if self._stop_watching is not None:
                self._stop_watching()
            self.trainer.close()
            if self.coordinator is not None:
                self.coordinator.close()
            self.done.set()

    def _step(self) -> bool:
        progress = self._say_bye()
        progress |= self.trainer.poll()
        if self.coordinator is not None:
            progress |= self.coordinator.poll()
        self._check_shutdown()
        return progress

    def _say_bye(self) -> bool:
        """Send BYE once shutdown was requested (after the main thread's last metric: same channel)."""
        with self._lock:
            say_bye = self._shutdown_at is not None and not self._bye_sent
            self._bye_sent |= say_bye
        if say_bye:
            self.trainer.send_up(BYE, -1)
        return say_bye

    def _check_shutdown(self) -> None:
        since = self._shutdown_at
        if since is None:
            return
        if self.coordinator is not None:
            self.coordinator.check_shutdown(since, self._shutdown_s)
        elif not self.trainer.finished and time.monotonic() - since > self._shutdown_s + _GRACE:
            raise CommTimeout(f"shutdown: no FIN from the population coordinator (rank {self.trainer.coordinator}) "
                              f"within {self._shutdown_s + _GRACE:g} s: still waiting for "
                              f"{self.trainer.waiting_for()}", (self.trainer.coordinator,))

    def _drain(self) -> None:
        """Let the last sends (FIN, ACK, BYE) complete before the thread ends."""
        self.trainer.drain(self.timeout)
        for handle in self._main_sends:
            handle.wait(self.timeout)
        if self.coordinator is not None:
            self.coordinator.drain(self.timeout)

    def _finished(self) -> bool:
        return self.trainer.finished and (self.coordinator is None or self.coordinator.finished)


def surface(error: BaseException | None) -> None:
    """Re-raise a background failure in the main thread as a popmesh error."""
    if error is None:
        return
    if isinstance(error, PopmeshError):
        raise error
    raise PopmeshError(f"the asynchronous population policy's background thread failed: "
                       f"{type(error).__name__}: {error}") from error

