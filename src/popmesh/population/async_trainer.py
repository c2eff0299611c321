"""The trainer side of the asynchronous policy, driven by its background thread.

Every step is a poll (``done()`` on posted receives and sends), never a blocking receive, so one
thread can also run the coordinator and a rank can be coordinator, donor and replaced at once
without deadlock. Only :mod:`popmesh.messages` point-to-point calls on internal tags are used here:
no collective is ever issued from this thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.errors import CommTimeout, PeerFailure, PopmeshError
from popmesh.messages import irecv, isend
from popmesh.population.async_protocol import ACK, Channels, metrics_by_rank, up_row
from popmesh.population.combine import _check_weights, combine
from popmesh.population.decision import Decision
from popmesh.world import World

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
    """:func:`combine` of flat float buffers, bit for bit, without its per-donor temporaries.

    ``combine`` computes ``acc = 0; acc += w_i * x_i.astype(float64)`` and casts back; here each
    term is computed in float64 straight into a scratch buffer (``np.multiply(..., dtype=float64)``:
    the same rounding), and the float64 accumulator and scratch are kept between decisions. Anything
    else (other dtypes, shapes, keys) goes to ``combine`` itself.
    """

    def __init__(self) -> None:
        self._scratch: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, per_donor: list[dict[str, np.ndarray]], weights: Any) -> dict[str, np.ndarray]:
        first = per_donor[0]
        leaves_ok = all(set(d) == set(first) for d in per_donor) and all(
            a.ndim == 1 and a.dtype in _FLOATS and all(d[k].dtype == a.dtype and d[k].shape == a.shape
                                                         for d in per_donor)
            for k, a in first.items())
        if not leaves_ok:
            return combine(per_donor, weights)
        w = _check_weights(weights, len(per_donor))
        out = {}
        for key, a in first.items():
            acc, term = self._buffers(a.size)
            acc.fill(0.0)
            for wi, d in zip(w, per_donor):
                np.multiply(d[key], wi, out=term, dtype=np.float64)
                acc += term
            out[key] = acc.astype(a.dtype)
        return out

    def _buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n not in self._scratch:
            self._scratch[n] = (np.empty(n, np.float64), np.empty(n, np.float64))
        return self._scratch[n]


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
    """A replacement in progress: the donors' data still to arrive."""

    decision: Decision
    ranks: list[int]
    metrics: dict[int, float]
    handles: dict[int, Any]
    deadline: float
    received: dict[int, dict[str, Any]] = field(default_factory=dict)


class TrainerLink:
    """Serve decisions for global rank ``me``: stream snapshots as a donor, combine as a replaced rank."""

    def __init__(self, world: World, coordinator: int, tags: Channels, timeout: float,
                 latest: Callable[[], Snapshot | None], deliver: Callable[[Pending], None]) -> None:
        self.world, self.me, self.coordinator, self.tags = world, world.rank, coordinator, tags
        self.timeout, self._latest, self._deliver = timeout, latest, deliver
        self._down = irecv(coordinator, tags.down, group=world)
        self._sends: list[Any] = []
        self._job: _Job | None = None
        self._combine_flat = _Combiner()
        self.finished = False

    def send_up(self, row: np.ndarray) -> None:
        """Queue one up row to the coordinator (ACK or BYE; background thread)."""
        self._sends.append(self.isend_up(row))

    def isend_up(self, row: np.ndarray) -> Any:
        """Start sending one up row to the coordinator; the caller keeps (and reaps) the handle."""
        return isend(row, self.coordinator, self.tags.up, group=self.world, timeout=self.timeout)

    def poll(self) -> bool:
        """Advance everything that can advance; True if a message arrived, was sent or a job finished
        (reaping a completed send is not progress: nothing follows from it)."""
        self._sends = reap(self._sends, self.timeout)  # a completed send is no progress: nothing follows
        progress = False
        if self._down.done():
            _, message = self._down.wait()
            self._down = irecv(self.coordinator, self.tags.down, group=self.world)
            self._handle(message)
            progress = True
        if self._job is not None:
            progress |= self._advance_job(self._job)
        return progress

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "fin":
            self.finished = True
        elif kind == "abort":
            raise PeerFailure(f"the population coordinator (rank {self.coordinator}) stopped: {message.get('reason')}",
                              (self.coordinator,))
        elif kind == "decision":
            self._decision(Decision.from_dict(message["decision"]), [int(r) for r in message["ranks"]],
                           metrics_by_rank(message["ranks"], message["metrics"]))
        else:
            raise PopmeshError(f"unknown message {kind!r} from the population coordinator: mixed popmesh versions?")

    def _decision(self, decision: Decision, ranks: list[int], metrics: dict[int, float]) -> None:
        me = ranks.index(self.me)
        recipients = [ranks[r] for r in decision.recipients(me)]
        if recipients:
            snap = self._latest()
            if snap is None:
                raise PopmeshError(f"rank {self.me} was asked to donate before taking any snapshot")
            payload = snap.payload(int(decision.iteration))
            for dst in recipients:
                self._sends.append(isend(payload, dst, self.tags.data, group=self.world, timeout=self.timeout,
                                         checksum=False))
        if me in decision.replaced:
            handles = {ranks[d]: irecv(ranks[d], self.tags.data, group=self.world) for d in decision.donors[me]}
            self._job = _Job(decision, ranks, metrics, handles, time.monotonic() + self.timeout)

    def _advance_job(self, job: _Job) -> bool:
        progress = False
        for donor, handle in list(job.handles.items()):
            if handle.done():
                job.received[donor] = handle.wait()[1]
                del job.handles[donor]
                progress = True
        if job.handles and time.monotonic() > job.deadline:
            self._fail_job(job)
        if not job.handles:
            self._deliver(self._combine(job))
            self.send_up(up_row(ACK, int(job.decision.iteration)))
            self._job = None
            progress = True
        return progress

    def _fail_job(self, job: _Job) -> None:
        donor, handle = next(iter(job.handles.items()))
        try:
            handle.wait(0.05)  # the engine tells a dead donor (PeerFailure) from a silent one
        except (PeerFailure, CommTimeout) as e:
            raise type(e)(f"rank {self.me} was replaced at iteration {job.decision.iteration} but donor(s) "
                          f"{sorted(job.handles)} sent nothing within {self.timeout:g} s: {e}",
                          (donor,)) from e

    def _combine(self, job: _Job) -> Pending:
        d, me = job.decision, job.ranks.index(self.me)
        donors = [job.ranks[x] for x in d.donors[me]]
        combined = None
        if donors:
            per_donor = [{k[2:]: _as_numpy(v) for k, v in job.received[g].items() if k.startswith("p/")}
                         for g in donors]
            combined = self._combine_flat(per_donor, d.weights[me])
        source = d.copy_optimizer_from[me]
        src = None if source is None else job.ranks[source]
        state = None if src is None else {k[2:]: v for k, v in job.received[src].items() if k.startswith("o/")}
        seen = tuple(int(job.received[g]["meta"][0]) for g in donors)
        return Pending(int(d.iteration), tuple(donors), d.weights[me], combined, state, src, d.strategy,
                       d.summary, d.reasons.get(me, ""), job.metrics, seen)

    def waiting_for(self) -> str:
        """What this side still waits for, for timeout messages."""
        if self._job is not None:
            return f"weights from donor(s) {sorted(self._job.handles)}"
        return f"FIN from the coordinator (rank {self.coordinator})" if not self.finished else "nothing"

    def drain(self, timeout: float) -> None:
        """Wait for every send in flight to complete."""
        for handle in self._sends:
            handle.wait(timeout)
        self._sends = []

    def close(self) -> None:
        """Withdraw the posted receives (dropping the handles withdraws them)."""
        self._down = None
        self._job = None

