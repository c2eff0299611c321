"""The trainer side of the asynchronous policy, driven by its background thread.

Every step is a poll (``done()`` on posted receives and sends), never a blocking receive, so one
thread can also run the coordinator and a rank can be coordinator, donor and replaced at once
without deadlock. Only :mod:`popmesh.comm.messages` point-to-point calls on internal tags are used here:
no collective is ever issued from this thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from popmesh.comm.messages import irecv, isend
from popmesh.comm.world import World
from popmesh.core.errors import CommTimeout, PeerClosed, PeerFailure, PopmeshError
from popmesh.population.decisions.decision import Decision
from popmesh.population.mechanisms.asynchronous.inbox import Inbox, Job, Pending, Snapshot
from popmesh.population.mechanisms.asynchronous.protocol import (
    ACK,
    BYE,
    Channels,
    metrics_by_rank,
    up_row,
)

__all__ = ["Pending", "Snapshot", "TrainerLink", "reap"]


def reap(handles: list[Any], timeout: float) -> list[Any]:
    """The send handles of ``handles`` still in flight; completed ones are waited on, which re-raises
    a failed send (PeerFailure)."""
    still = []
    for handle in handles:
        if handle.done():
            handle.wait(timeout)
        else:
            still.append(handle)
    return still


class TrainerLink:
    """Serve decisions for global rank ``me`` of the training ranks ``ranks``: stream snapshots as a
    donor, combine as a replaced rank, acknowledge, and send the main thread's metric rows."""

    def __init__(self, world: World, ranks: list[int], coordinator: int, tags: Channels, timeout: float,
                 latest: Callable[[], Snapshot | None], deliver: Callable[[Pending], None]) -> None:
        self.world, self.me, self.coordinator, self.tags = world, world.rank, coordinator, tags
        self.timeout, self._latest, self._deliver = timeout, latest, deliver
        self._ranks = list(ranks)  # group rank -> global rank, as on the coordinator
        self._peers = [r for r in ranks if r != self.me]
        self._members = frozenset(ranks) | {coordinator}
        self._down = irecv(coordinator, tags.down, group=world) if coordinator != self.me else None
        self._data = irecv(self._peers, tags.data, group=world) if self._peers else None
        self._sends: list[Any] = []
        self._inbox = Inbox(self.me)
        self._up_lock = threading.Lock()  # rows go up from the main thread (METRIC) and this one
        self._acked = -1  # newest decision iteration combined and handed over
        self._reported: float = -1  # newest iteration reported up (BYE: infinity)
        self.rounds: set[int] = set()  # rounds the coordinator resolved (decide="latest" with a lag)
        self.finished = False

    # ---- up rows (main thread and background thread) ------------------------------------------
    def isend_up(self, kind: int, iteration: int, metric: float = math.nan, fingerprint: int = 0, steps: int = -1,
                 generation: int = 0, objective: float = math.nan, hparams: Any = ()) -> Any:
        """Start sending one up row carrying the newest acknowledgement; the caller reaps the handle."""
        with self._up_lock:
            self._reported = max(self._reported, math.inf if kind == BYE else iteration)
            return self._send_row(up_row(kind, iteration, metric, fingerprint, self._acked, steps, generation,
                                         objective, hparams))

    def _send_row(self, row: np.ndarray) -> Any:
        return isend(row, self.coordinator, self.tags.up, group=self.world, timeout=self.timeout)

    def send_up(self, kind: int, iteration: int) -> None:
        """Queue one up row (BYE; background thread)."""
        self._sends.append(self.isend_up(kind, iteration))

    def _acknowledge(self, iteration: int) -> None:
        """Record a finished replacement; say so at once only if a newer report already went up
        without it (the coordinator may be waiting), else the next row carries it."""
        with self._up_lock:
            self._acked = iteration
            if self._reported > iteration:
                self._sends.append(self._send_row(up_row(ACK, iteration, acked=iteration)))

    # ---- background thread ----------------------------------------------------------------------
    def poll(self) -> bool:
        """Advance everything that can advance; True if a message arrived or a job finished
        (reaping a completed send is not progress: nothing follows from it). A member the heartbeat
        found frozen or dead ends the policy here, within seconds."""
        failure = self.world.failure(self._members)
        if failure is not None:
            raise failure
        self._sends = reap(self._sends, self.timeout)
        progress = False
        if self._down is not None and self._down.done():
            _, message = self._down.wait()
            self._down = irecv(self.coordinator, self.tags.down, group=self.world)
            self.handle(message)
            progress = True
        if self.finished:
            return progress  # FIN follows every finished replacement: no stream can come after it
        while self._stream_waiting():
            assert self._data is not None  # _stream_waiting() is True only while a receive is posted
            src, payload = self._data.wait()
            self._data = irecv(self._peers, self.tags.data, group=self.world)
            self._finish(self._inbox.stream(src, payload))
            progress = True
        if self._inbox.job is not None and time.monotonic() > self._inbox.job.deadline:
            self._fail_job(self._inbox.job)
        return progress

    def _stream_waiting(self) -> bool:
        """Whether a donor's stream has arrived. When every peer has closed its transport in order
        (PeerClosed), they finished: nothing more streams in, so unless a job still waits for a donor
        the data channel is withdrawn, and the coordinator's FIN or abort decides the rest (a peer
        finalizes once it has FIN, maybe before this thread has read its own)."""
        if self._data is None:
            return False
        try:
            return self._data.done()
        except PeerClosed:
            if self._inbox.job is not None:
                raise
            self._data = None
            return False

    def handle(self, message: dict[str, Any]) -> None:
        """One message of the coordinator (from the down channel, or handed over in-process)."""
        kind = message.get("kind")
        if kind == "fin":
            self.finished = True
        elif kind == "abort":
            lost = tuple(int(r) for r in message.get("lost") or ()) or (self.coordinator,)
            raise PeerFailure(f"the population coordinator (rank {self.coordinator}) stopped: {message.get('reason')}",
                              lost)
        elif kind == "decision":
            self._decision(message)
        elif kind == "round":
            self.rounds.add(int(message["iteration"]))
        else:
            raise PopmeshError(f"unknown message {kind!r} from the population coordinator: mixed popmesh versions?")

    def _job_of(self, message: dict[str, Any]) -> tuple[Job, int]:
        """The decision in ``message`` as a job for this rank (donors empty unless it is replaced by
        donors), and this rank's group rank in it."""
        decision, ranks = Decision.from_dict(message["decision"]), self._ranks
        me = ranks.index(self.me)
        donors = [ranks[d] for d in decision.donors.get(me, ())]
        source = decision.copy_optimizer_from.get(me)
        iterations = {ranks[g]: int(i) for g, i in enumerate(message.get("iterations") or ()) if i is not None}
        return Job(decision, ranks, metrics_by_rank(ranks, message["metrics"]), donors,
                   None if source is None else ranks[source], time.monotonic() + self.timeout,
                   iterations=iterations, hparams=message.get("hparams"), inherited=message.get("inherited")), me

    def _decision(self, message: dict[str, Any]) -> None:
        """The coordinator's decision: stream to its recipients as a donor, open the job as a replaced rank."""
        job, me = self._job_of(message)
        decision, ranks = job.decision, job.ranks
        recipients = [ranks[r] for r in message["recipients"]]  # this rank's part only (decision_messages)
        if recipients:
            snap = self._latest()
            if snap is None:
                raise PopmeshError(f"rank {self.me} was asked to donate before taking any snapshot")
            payload = snap.payload(job.iteration)
            for dst in recipients:
                self._sends.append(isend(payload, dst, self.tags.data, group=self.world, timeout=self.timeout,
                                         checksum=False))
        if me in decision.replaced:
            self._finish(self._inbox.open(job))

    def _finish(self, done: Pending | None) -> None:
        """Hand a finished replacement to the main thread and acknowledge it."""
        if done is not None:
            self._deliver(done)
            self._acknowledge(done.decision_iteration)

    def _fail_job(self, job: Job) -> None:
        donor = job.missing()[0]
        probe = irecv(donor, self.tags.data, group=self.world)
        try:
            src, payload = probe.wait(0.05)  # the engine tells a dead donor (PeerFailure) from a silent one
        except (PeerFailure, CommTimeout) as e:
            raise type(e)(f"rank {self.me} was replaced at iteration {job.iteration} but donor(s) {job.missing()} "
                          f"sent nothing within {self.timeout:g} s: {e}", (donor,)) from e
        self._finish(self._inbox.stream(src, payload))  # it arrived just now

    def round_resolved(self, iteration: int) -> bool:
        """Whether round ``iteration`` is resolved for this rank: the coordinator's notice is here and a
        replacement it decided for this rank has been combined (delivered). Read by the main thread."""
        job = self._inbox.job
        return self.finished or (iteration in self.rounds and (job is None or job.iteration != iteration))

    def waiting_for(self) -> str:
        """What this side still waits for, for timeout messages."""
        if self._inbox.job is not None:
            return f"weights from donor(s) {self._inbox.job.missing()}"
        return f"FIN from the coordinator (rank {self.coordinator})" if not self.finished else "nothing"

    def drain(self, timeout: float) -> None:
        """Wait for every send in flight to complete."""
        for handle in self._sends:
            handle.wait(timeout)
        self._sends = []

    def close(self) -> None:
        """Withdraw the posted receives (dropping the handles withdraws them)."""
        self._down = None
        self._data = None
        self._inbox.clear()
