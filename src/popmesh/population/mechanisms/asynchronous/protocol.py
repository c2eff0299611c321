"""The asynchronous policy's messages and the coordinator's bookkeeping: pure, no communication.

Three channels per policy instance, on popmesh-internal tags (:data:`popmesh.comm.messages.POPULATION_TAGS`):

* **up** (trainer → coordinator), one float64 row :class:`Up` ``[kind, iteration, metric,
  fingerprint, acked, steps, generation, objective, hparams...]`` where kind is METRIC, ACK (a
  replaced rank has combined its donors' weights for a decision) or BYE (the rank is shutting down:
  it sends nothing more but keeps serving until FIN), ``acked`` the newest decision iteration this
  rank has combined (-1: none), ``steps`` its experience and ``generation`` how many replacements
  its main thread has applied (a report of older weights is then told apart), ``objective`` what
  selection ranks by (NaN: the metric) and ``hparams`` the explored hyper-parameters' values, two
  floats each (:mod:`~popmesh.population.decisions.hparams`). A replaced rank's acknowledgement
  usually rides in its next METRIC row; it sends an ACK row of its own only when it finished
  combining after it had already reported a newer iteration (the coordinator may then be waiting for
  it).
* **down** (coordinator → trainer), JSON: a decision, ``fin`` (everyone said BYE: stop) or ``abort``
  (the coordinator failed: the reason). The coordinator makes each decision once and sends every
  rank it involves (:func:`involved`: donors and replaced ranks), nobody else, its own part
  (:func:`decision_messages`): ``Decision.part(rank).to_dict()`` over group ranks (its own donors
  and weights if it is replaced), ``recipients`` (the group ranks it streams its weights to) and the
  metrics (for ``PolicyInfo.metrics``), with, for a replaced rank whose policy explores, ``hparams``
  (the values to train at) and ``inherited`` (its donor's), encoded; both sides map group ranks to
  global ranks with the group they were built with. A message is O(n + donors + recipients) bytes,
  not the whole decision: averaging all others at 1,024 ranks would be O(n²) per message.
* **data** (donor → replaced), a dict of arrays: ``meta`` ``[snapshot iteration, decision
  iteration]``, ``p/<dtype>`` flat weights, ``o/<index>/<key>`` optimizer state. A stream names
  its decision only by iteration: a replaced rank whose donors' streams arrive before the
  coordinator's message keeps them, keyed by that iteration, until the decision comes.

One channel carries each direction, so per-sender order holds: a rank's metrics always precede
its BYE, and a decision always precedes FIN.

:class:`CoordinatorBook` decides *when* to decide: at most one decision in flight (until every
replaced rank acknowledged it), always on the newest iteration whose metrics are complete (older
complete ones are skipped), FIN once every rank said BYE and nothing is in flight. It serves the
``decide="complete"`` protocol; :mod:`~popmesh.population.mechanisms.asynchronous.deciders` holds
the default one, which judges each report as it arrives. Fewer messages
matter: with more ranks than cores each one costs its receiver a few hundred microseconds of CPU
that training would otherwise use.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from popmesh.comm.messages import INTERNAL_TAG_BASE, POPULATION_TAGS, internal_tag
from popmesh.core.errors import ConfigError

__all__ = [
    "METRIC", "ACK", "BYE", "MAX_INSTANCES", "Channels", "channels", "Up", "up_row", "parse_up", "decision_messages",
    "recipients_of", "check_fingerprint", "involved", "metrics_by_rank", "CoordinatorBook",
]

METRIC, ACK, BYE = 0, 1, 2
_PER_INSTANCE = 3
MAX_INSTANCES = len(POPULATION_TAGS) // _PER_INSTANCE


@dataclass(frozen=True)
class Channels:
    """The three internal tags of one policy instance."""

    up: int
    down: int
    data: int


def channels(instance: int) -> Channels:
    """Tags of policy instance ``instance`` (0 ≤ instance < MAX_INSTANCES)."""
    if isinstance(instance, bool) or not isinstance(instance, int) or not 0 <= instance < MAX_INSTANCES:
        raise ConfigError(f"channel={instance!r}: asynchronous policies use channels 0..{MAX_INSTANCES - 1}; "
                          "pass channel= explicitly (the same on every rank) when creating more policies")
    base = POPULATION_TAGS.start - INTERNAL_TAG_BASE + _PER_INSTANCE * instance
    return Channels(*(internal_tag(base + i) for i in range(_PER_INSTANCE)))


class Up(NamedTuple):
    """One up row, parsed."""

    kind: int
    iteration: int
    metric: float
    fingerprint: int
    acked: int
    steps: int
    generation: int
    objective: float = math.nan
    hparams: tuple[float, ...] = ()


_UP_SIZE = len(Up._fields) - 1  # the fixed fields; the encoded hyper-parameters follow


def up_row(kind: int, iteration: int, metric: float = math.nan, fingerprint: int = 0, acked: int = -1,
           steps: int = -1, generation: int = 0, objective: float = math.nan,
           hparams: Any = ()) -> np.ndarray:
    """The float64 row a trainer sends up (fingerprints are 52-bit and steps below 2**53: exact in
    float64); ``hparams``: the encoded values (:func:`~popmesh.population.decisions.hparams.encode`)."""
    head = np.array([kind, iteration, metric, fingerprint, acked, steps, generation, objective], dtype=np.float64)
    return np.concatenate([head, np.asarray(hparams, dtype=np.float64).reshape(-1)]) if len(hparams) else head


def parse_up(row: Any) -> Up:
    """The :class:`Up` of an up row; ConfigError for anything else."""
    a = np.asarray(row, dtype=np.float64).reshape(-1)
    if a.size < _UP_SIZE or (a.size - _UP_SIZE) % 2 or int(a[0]) not in (METRIC, ACK, BYE):
        raise ConfigError(f"not an asynchronous-policy message (mixed popmesh versions?): {a[:8].tolist()}")
    return Up(int(a[0]), int(a[1]), float(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]), float(a[7]),
              tuple(float(x) for x in a[_UP_SIZE:]))


def check_fingerprint(fingerprints: dict[int, int], rank: int, fingerprint: int) -> None:
    """Book group rank ``rank``'s model layout; ConfigError naming every rank's when they differ."""
    known = fingerprints.setdefault(rank, fingerprint)
    if known != fingerprint or len(set(fingerprints.values())) > 1:
        per_rank = ", ".join(f"group rank {r}: {p:#x}" for r, p in sorted(fingerprints.items()))
        raise ConfigError(f"model layouts differ across the group ({per_rank}; now {fingerprint:#x} from "
                          f"group rank {rank}): every agent must have the same architecture")


def recipients_of(decision: Any) -> dict[int, list[int]]:
    """Group rank → the replaced group ranks (ascending) it donates to, for every donor.

    One pass over the distinct donor tuples (:func:`decide` shares one among all replaced ranks
    of a deterministic rule), not ``decision.recipients(d)`` per donor, which is O(n³) when every
    rank averages all others."""
    groups: dict[int, tuple[tuple[int, ...], list[int]]] = {}
    for r in decision.replaced:
        donors = decision.donors[r]
        groups.setdefault(id(donors), (donors, []))[1].append(r)
    out: dict[int, list[int]] = {}
    for donors, replaced in groups.values():
        for d in donors:
            if d in out:
                out[d] = sorted(out[d] + replaced)
            else:
                out[d] = replaced  # shared, read only
    return out


def decision_messages(decision: Any, metrics: Sequence[float],
                      iterations: Sequence[int | None] | None = None) -> dict[int, dict[str, Any]]:
    """Group rank → the JSON sent down to it, for every rank ``decision`` involves (non-finite
    metrics as null): its part of the decision and whom it streams to, not the whole decision.
    ``iterations`` (index = group rank, None: not compared): each member's report the decision read."""
    finite = [m if math.isfinite(m) else None for m in metrics]
    recipients = recipients_of(decision)
    out = {g: {"kind": "decision", "decision": decision.part(g).to_dict(), "recipients": recipients.get(g, []),
               "metrics": finite}
           for g in sorted(set(recipients) | set(decision.replaced))}
    if iterations is not None:
        for g in decision.replaced:  # only the replaced rank shows them (PolicyInfo.report_iterations)
            out[g]["iterations"] = list(iterations)
    return out


@dataclass
class CoordinatorBook:
    """Metrics per iteration, the decision in flight and who said BYE, for a group of ``n`` (group ranks)."""

    n: int
    max_pending: int = 64
    buckets: dict[int, dict[int, float]] = field(default_factory=dict)
    opened: dict[int, float] = field(default_factory=dict)
    fingerprints: dict[int, int] = field(default_factory=dict)
    in_flight: dict[int, int] = field(default_factory=dict)  # replaced rank -> decision iteration
    byes: set[int] = field(default_factory=set)
    latest: dict[int, int] = field(default_factory=dict)  # group rank -> newest iteration it reported
    decided_upto: int = -1
    skipped: int = 0

    def record(self, kind: int, rank: int, iteration: int, metric: float, fingerprint: int,
               now: float | None = None, acked: int = -1) -> None:
        """Book one up message from group rank ``rank`` (``acked``: the newest decision it combined)."""
        self._acknowledge(rank, iteration if kind == ACK else acked)
        if kind == METRIC:
            self._metric(rank, iteration, metric, fingerprint, time.monotonic() if now is None else now)
        elif kind == BYE:
            self.byes.add(rank)

    def _acknowledge(self, rank: int, acked: int) -> None:
        if rank in self.in_flight and acked >= self.in_flight[rank]:
            del self.in_flight[rank]

    def _metric(self, rank: int, iteration: int, metric: float, fingerprint: int, now: float) -> None:
        check_fingerprint(self.fingerprints, rank, fingerprint)
        self.latest[rank] = max(self.latest.get(rank, iteration), iteration)
        if iteration <= self.decided_upto:
            return
        self.buckets.setdefault(iteration, {})[rank] = metric
        self.opened.setdefault(iteration, now)
        while len(self.buckets) > self.max_pending:
            oldest = min(self.buckets)
            del self.buckets[oldest]
            self.opened.pop(oldest, None)

    def next_decision(self) -> tuple[int, list[float]] | None:
        """The newest complete iteration and its metrics (index = group rank) if one may be decided now;
        older complete iterations are dropped and counted in ``skipped``."""
        if self.in_flight:
            return None
        complete = [it for it, b in self.buckets.items() if len(b) == self.n]
        if not complete:
            return None
        newest = max(complete)
        self.skipped += len(complete) - 1
        metrics = [self.buckets[newest][r] for r in range(self.n)]
        for it in [it for it in self.buckets if it <= newest]:
            del self.buckets[it]
            self.opened.pop(it, None)
        self.decided_upto = newest
        return newest, metrics

    def dispatched(self, replaced: Sequence[int], iteration: int) -> None:
        """The decision of ``iteration`` went out: wait until each of ``replaced`` acknowledged it."""
        self.in_flight = {int(r): int(iteration) for r in replaced}

    def finished(self) -> bool:
        """Every rank said BYE and no decision is in flight: send FIN."""
        return len(self.byes) == self.n and not self.in_flight

    def stalled(self, now: float, timeout: float) -> tuple[int, list[int]] | None:
        """``(iteration, missing group ranks)`` of the oldest incomplete iteration older than ``timeout``
        seconds, if any: those ranks stopped reporting (died, or are far behind). A rank that has since
        reported a later iteration passed this one without it (it started later: a rank that rejoined
        with its donor's iteration) and is not missing."""
        for it in sorted(self.opened):
            missing = [r for r in range(self.n)
                       if r not in self.buckets[it] and r not in self.byes and self.latest.get(r, it - 1) < it]
            if now - self.opened[it] > timeout and missing:
                return it, missing
        return None

    def missing_acks(self) -> list[int]:
        """Replaced group ranks that have not acknowledged the decision in flight."""
        return sorted(self.in_flight)


def involved(decision: Any) -> list[int]:
    """Group ranks the coordinator sends a decision to: its donors and the ranks it replaces."""
    return sorted(set(decision.donor_ranks) | set(decision.replaced))


def metrics_by_rank(ranks: Sequence[int], metrics: Sequence[float | None]) -> dict[int, float]:
    """Global rank → metric, null (JSON) back to NaN."""
    return {int(g): (math.nan if m is None else float(m)) for g, m in zip(ranks, metrics)}
