"""A replaced rank's side of an asynchronous decision: donors' streams combined into one :class:`Pending`.

Pure: no communication. The trainer's background thread hands it the coordinator's decision
(:meth:`Inbox.open`) and each donor's stream (:meth:`Inbox.stream`) in whatever order they arrive:
they travel on separate channels from separate senders, so a stream may come before its decision;
it is kept, keyed by decision iteration, until the decision opens its job. Streams are combined in
donor order, bit for bit like :func:`~popmesh.population.decisions.combine.combine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.core.errors import PopmeshError
from popmesh.population.decisions.combine import check_weights, combine
from popmesh.population.decisions.decision import Decision

__all__ = ["Pending", "Snapshot", "Job", "Inbox"]


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
    report_iterations: dict[int, int] = field(default_factory=dict)  # global rank -> its report's iteration
    hparams: list[float] | None = None  # encoded values to train at (decide="latest" with explored keys)
    inherited: list[float] | None = None  # encoded: the donor's values, before the explore step


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
        self._begin(tuple(check_weights(weights, donors)))

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


def _as_numpy(t: Any) -> np.ndarray:
    import torch

    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


@dataclass
class Job:
    """A decision as this rank sees it; when it replaces this rank, the donors' streams combined in
    donor order as they arrive."""

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
    iterations: dict[int, int] = field(default_factory=dict)  # global rank -> iteration of the report read
    hparams: list[float] | None = None  # encoded values assigned by the coordinator (Pending.hparams)
    inherited: list[float] | None = None

    @property
    def iteration(self) -> int:
        assert self.decision.iteration is not None  # the coordinator's decisions carry their iteration
        return int(self.decision.iteration)

    def missing(self) -> list[int]:
        return [d for d in self.donors[self.combined:] if d not in self.waiting]


class Inbox:
    """The job of global rank ``me`` and the streams that came before their decision."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.job: Job | None = None
        self._early: dict[int, dict[int, dict[str, Any]]] = {}  # decision iteration -> donor -> stream
        self._combiner = _Combiner()

    def open(self, job: Job) -> Pending | None:
        """Start combining ``job`` (a decision that replaces this rank), with any streams already
        here; the finished replacement if nothing more is needed."""
        if self.job is not None:
            raise PopmeshError(f"rank {self.me} was replaced at iteration {job.iteration} while still combining "
                               f"decision {self.job.iteration}: mixed popmesh versions?")
        early = self._early.pop(job.iteration, {})
        if self._early:
            raise PopmeshError(f"rank {self.me} holds weights from donors for decision(s) {sorted(self._early)} "
                               f"that never replaced it (now decision {job.iteration}): mixed popmesh versions?")
        if not job.donors:  # reset_weights: nothing to wait for
            return self._finish(job)
        self.job = job
        self._combiner.begin(len(job.donors), job.decision.weights[job.ranks.index(self.me)])
        done = None
        for src, payload in early.items():
            done = self._take(job, src, payload)
        return done

    def stream(self, src: int, payload: dict[str, Any]) -> Pending | None:
        """Donor ``src``'s stream: combined into the open job of its decision, or kept until that
        decision opens; the finished replacement once the last donor is in."""
        iteration = int(payload["meta"][1])
        job = self.job
        if job is not None and job.iteration == iteration:
            return self._take(job, src, payload)
        if job is not None or src in self._early.get(iteration, {}):
            current = f"decision {job.iteration} from donors {job.donors}" if job is not None else "no decision yet"
            raise PopmeshError(f"rank {self.me} got weights from rank {src} for decision {iteration} while combining "
                               f"{current}: streams must not interleave")
        self._early.setdefault(iteration, {})[src] = payload
        return None

    def early(self) -> dict[int, list[int]]:
        """Decision iteration → donors whose streams wait for that decision."""
        return {it: sorted(by) for it, by in self._early.items()}

    def clear(self) -> None:
        """Forget the job and the kept streams (the policy is closing)."""
        self.job = None
        self._early = {}

    def _take(self, job: Job, src: int, payload: dict[str, Any]) -> Pending | None:
        if src not in job.missing():
            raise PopmeshError(f"rank {self.me} got weights from rank {src} for decision {job.iteration}, which "
                               f"replaces it by donors {job.donors}: mixed popmesh versions?")
        job.waiting[src] = payload
        while job.combined < len(job.donors) and job.donors[job.combined] in job.waiting:
            self._add(job, job.donors[job.combined])
        return self._finish(job) if job.combined == len(job.donors) else None

    def _add(self, job: Job, donor: int) -> None:
        payload = job.waiting.pop(donor)
        self._combiner.add({k[2:]: _as_numpy(v) for k, v in payload.items() if k.startswith("p/")})
        job.seen[donor] = int(payload["meta"][0])
        if donor == job.source:
            job.state = {k[2:]: v for k, v in payload.items() if k.startswith("o/")}
        job.combined += 1

    def _finish(self, job: Job) -> Pending:
        d, me = job.decision, job.ranks.index(self.me)
        combined = self._combiner.result() if job.donors else None
        self.job = None
        return Pending(job.iteration, tuple(job.donors), d.weights[me], combined, job.state, job.source,
                       d.strategy, d.summary_in(job.ranks), d.reasons.get(me, ""), job.metrics,
                       tuple(job.seen[g] for g in job.donors), job.iterations, job.hparams, job.inherited)
