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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.comm.messages import irecv, isend
from popmesh.comm.world import World
from popmesh.core.errors import CommTimeout, PeerClosed, PeerFailure, PopmeshError
from popmesh.population.async_protocol import (
    ACK,
    BYE,
    Channels,
    decision_bytes,
    decision_from_bytes,
    metrics_by_rank,
    up_row,
)
from popmesh.population.combine import _check_weights, combine
from popmesh.population.decision import Decision

__all__ = ["Pending", "Snapshot", "TrainerLink", "reap"]


@dataclass
class Snapshot:
    """A copy of this rank's weights (per-dtype flat tensors) and optimizer state at ``iteration``."""

    iteration: int
    weights: dict[str, Any]
    optimizer: dict[str, Any] = field(default_factory=dict)

    def payload(self, decision_iteration: int) -> dict[str, Any]:
        out: dict[str, Any] = {"meta": np.array([self.iteration, decision_iteration], dtype=np.int64)}
        out.update({f"p/{dt}": t.detach().cpu() for dt, t in self.weights.items()})
        out.update({f"o/{name}": t for name, t in self.optimizer.items()})
        return out


@dataclass
class Pending:
    """A replacement combined in the background, waiting for the main thread to swap it in."""

    decision_iteration: int
    donors: tuple[int, ...]
    weights: tuple[float, ...]
    combined: dict[str, np.ndarray] | None
    donor_state: dict[str, Any] | None
    source: int | None
    strategy: str
    summary: str
    reason: str
    metrics: dict[int, float]
    snapshot_iterations: tuple[int, ...] = ()


_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class _Combiner:
    """:func:`combine` of flat float buffers, bit for bit, one donor at a time as its stream arrives.

    ``combine`` computes ``acc = 0; acc += w_i * x_i.astype(float64)`` in donor order and casts
    back; here each term is computed in float64 straight into a scratch buffer
    (``np.multiply(..., dtype=float64)``: the same rounding) and added when donor ``i`` is next in
    order, while its data is still in cache; accumulators and scratch are kept between decisions.
    Anything else (other dtypes, shapes, keys) goes to ``combine`` itself at the end.
    """

    def __init__(self) -> None:
        self._scratch: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._begin(())

    def begin(self, donors: int, weights: Any) -> None:
        """Start a combination of ``donors`` donors with ``weights`` (checked like ``combine``)."""
        self._begin(tuple(_check_weights(weights, donors)))

    def _begin(self, weights: tuple[float, ...]) -> None:
        self._weights: tuple[float, ...] = weights
        self._given: list[dict[str, np.ndarray]] = []
        self._sums: dict[str, np.ndarray] | None = None
        self._flat = True

    def add(self, arrays: dict[str, np.ndarray]) -> None:
        """The next donor's arrays, in donor order."""
        self._given.append(arrays)
        if self._flat and not self._fits(arrays):
            self._flat = False
        if not self._flat:
            return
        w = self._weights[len(self._given) - 1]
        if self._sums is None:
            self._sums = {}
            for key, a in arrays.items():
                acc, _ = self._buffers(key, a.size)
                acc.fill(0.0)
                self._sums[key] = acc
        for key, a in arrays.items():
            acc, term = self._buffers(key, a.size)
            np.multiply(a, w, out=term, dtype=np.float64)
            acc += term

    def _fits(self, arrays: dict[str, np.ndarray]) -> bool:
        first = self._given[0]
        return (set(arrays) == set(first)
                and all(a.ndim == 1 and a.dtype in _FLOATS and arrays[k].dtype == a.dtype and arrays[k].shape == a.shape
                        for k, a in first.items()))

    def result(self) -> dict[str, np.ndarray]:
        """The combination of the donors added since :meth:`begin`."""
        given, weights = self._given, self._weights
        if len(given) != len(weights):
            raise PopmeshError(f"combined {len(given)} donors, expected {len(weights)}")
        out = ({k: acc.astype(given[0][k].dtype) for k, acc in self._sums.items()}
               if self._flat and self._sums is not None else combine(given, weights))
        self._begin(())
        return out

    def _buffers(self, key: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        if (key, n) not in self._scratch:
            self._scratch[(key, n)] = (np.empty(n, np.float64), np.empty(n, np.float64))
        return self._scratch[(key, n)]


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


def _as_numpy(t: Any) -> np.ndarray:
    import torch

    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


@dataclass
class _Job:
    """A replacement in progress: donors' streams combined in donor order as they arrive."""

    decision: Decision
    ranks: list[int]
    metrics: dict[int, float]
    donors: list[int]  # global, in the decision's order
    source: int | None  # global rank whose optimizer state is copied, if any
    deadline: float
    waiting: dict[int, dict[str, Any]] = field(default_factory=dict)  # arrived, not yet combined
    combined: int = 0  # donors[:combined] are in the sum
    seen: dict[int, int] = field(default_factory=dict)  # donor -> iteration of its snapshot
    state: dict[str, Any] | None = None  # optimizer state of the source donor

    @property
    def iteration(self) -> int:
        assert self.decision.iteration is not None  # the coordinator's decisions carry their iteration
        return int(self.decision.iteration)

    def missing(self) -> list[int]:
        return [d for d in self.donors[self.combined:] if d not in self.waiting]


class TrainerLink:
    """Serve decisions for global rank ``me`` of the training ranks ``ranks``: stream snapshots as a
    donor, combine as a replaced rank, acknowledge, and send the main thread's metric rows."""

    def __init__(self, world: World, ranks: list[int], coordinator: int, tags: Channels, timeout: float,
                 latest: Callable[[], Snapshot | None], deliver: Callable[[Pending], None]) -> None:
        self.world, self.me, self.coordinator, self.tags = world, world.rank, coordinator, tags
        self.timeout, self._latest, self._deliver = timeout, latest, deliver
        self._peers = [r for r in ranks if r != self.me]
        self._down = irecv(coordinator, tags.down, group=world) if coordinator != self.me else None
        self._data = irecv(self._peers, tags.data, group=world) if self._peers else None
        self._sends: list[Any] = []
        self._job: _Job | None = None
        self._combiner = _Combiner()
        self._up_lock = threading.Lock()  # rows go up from the main thread (METRIC) and this one
        self._acked = -1  # newest decision iteration combined and handed over
        self._reported: float = -1  # newest iteration reported up (BYE: infinity)
        self.finished = False

    # ---- up rows (main thread and background thread) ------------------------------------------
    def isend_up(self, kind: int, iteration: int, metric: float = math.nan, fingerprint: int = 0) -> Any:
        """Start sending one up row carrying the newest acknowledgement; the caller reaps the handle."""
        with self._up_lock:
            self._reported = max(self._reported, math.inf if kind == BYE else iteration)
            return self._send_row(up_row(kind, iteration, metric, fingerprint, self._acked))

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
        (reaping a completed send is not progress: nothing follows from it)."""
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
            self._stream(src, payload)
            progress = True
        if self._job is not None and time.monotonic() > self._job.deadline:
            self._fail_job(self._job)
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
            if self._job is not None:
                raise
            self._data = None
            return False

    def handle(self, message: dict[str, Any]) -> None:
        """One message of the coordinator (from the down channel, or handed over in-process)."""
        kind = message.get("kind")
        if kind == "fin":
            self.finished = True
        elif kind == "abort":
            raise PeerFailure(f"the population coordinator (rank {self.coordinator}) stopped: {message.get('reason')}",
                              (self.coordinator,))
        elif kind == "decision":
            self._decision(message)
        else:
            raise PopmeshError(f"unknown message {kind!r} from the population coordinator: mixed popmesh versions?")

    def _job_of(self, message: dict[str, Any], deadline: float) -> tuple[_Job, int]:
        """The decision in ``message`` as a job for this rank (donors empty unless it is replaced by
        donors), and this rank's group rank in it."""
        decision, ranks = Decision.from_dict(message["decision"]), [int(r) for r in message["ranks"]]
        me = ranks.index(self.me)
        donors = [ranks[d] for d in decision.donors.get(me, ())]
        source = decision.copy_optimizer_from.get(me)
        return _Job(decision, ranks, metrics_by_rank(ranks, message["metrics"]), donors,
                    None if source is None else ranks[source], deadline), me

    def _decision(self, message: dict[str, Any]) -> None:
        job, me = self._job_of(message, math.inf)
        decision, ranks = job.decision, job.ranks
        recipients = [ranks[r] for r in decision.recipients(me)]
        if recipients:
            snap = self._latest()
            if snap is None:
                raise PopmeshError(f"rank {self.me} was asked to donate before taking any snapshot")
            payload = snap.payload(job.iteration)
            payload["decision"] = decision_bytes(message)
            for dst in recipients:
                self._sends.append(isend(payload, dst, self.tags.data, group=self.world, timeout=self.timeout,
                                         checksum=False))
        if me in decision.replaced and not job.donors:  # reset_weights: nothing to wait for
            self._finish(job)

    def _stream(self, src: int, payload: dict[str, Any]) -> None:
        """A donor's stream: open the job on the first one, combine those whose turn has come."""
        job = self._job
        if job is None:
            job, me = self._job_of(decision_from_bytes(payload["decision"]), time.monotonic() + self.timeout)
            if not job.donors:
                raise PopmeshError(f"rank {self.me} got weights from rank {src} for a decision that does not replace "
                                   "it by donors: mixed popmesh versions?")
            self._job = job
            self._combiner.begin(len(job.donors), job.decision.weights[me])
        iteration = int(payload["meta"][1])
        if src not in job.missing() or iteration != job.iteration:
            raise PopmeshError(f"rank {self.me} got weights from rank {src} for decision {iteration} while combining "
                               f"decision {job.iteration} from donors {job.donors}: streams must not interleave")
        job.waiting[src] = payload
        while job.combined < len(job.donors) and job.donors[job.combined] in job.waiting:
            self._add(job, job.donors[job.combined])
        if job.combined == len(job.donors):
            self._finish(job)

    def _add(self, job: _Job, donor: int) -> None:
        payload = job.waiting.pop(donor)
        self._combiner.add({k[2:]: _as_numpy(v) for k, v in payload.items() if k.startswith("p/")})
        job.seen[donor] = int(payload["meta"][0])
        if donor == job.source:
            job.state = {k[2:]: v for k, v in payload.items() if k.startswith("o/")}
        job.combined += 1

    def _finish(self, job: _Job) -> None:
        d, me = job.decision, job.ranks.index(self.me)
        combined = self._combiner.result() if job.donors else None
        self._deliver(Pending(job.iteration, tuple(job.donors), d.weights[me], combined, job.state, job.source,
                              d.strategy, d.summary, d.reasons.get(me, ""), job.metrics,
                              tuple(job.seen[g] for g in job.donors)))
        self._job = None
        self._acknowledge(job.iteration)

    def _fail_job(self, job: _Job) -> None:
        donor = job.missing()[0]
        probe = irecv(donor, self.tags.data, group=self.world)
        try:
            src, payload = probe.wait(0.05)  # the engine tells a dead donor (PeerFailure) from a silent one
        except (PeerFailure, CommTimeout) as e:
            raise type(e)(f"rank {self.me} was replaced at iteration {job.iteration} but donor(s) {job.missing()} "
                          f"sent nothing within {self.timeout:g} s: {e}", (donor,)) from e
        self._stream(src, payload)  # it arrived just now

    def waiting_for(self) -> str:
        """What this side still waits for, for timeout messages."""
        if self._job is not None:
            return f"weights from donor(s) {self._job.missing()}"
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
        self._job = None
