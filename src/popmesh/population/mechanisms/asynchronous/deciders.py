"""When and what the asynchronous coordinator decides: two deciders behind one Protocol, both pure.

The coordinator (:class:`~popmesh.population.mechanisms.asynchronous.coordinator.CoordinatorLink`)
hands every up row to its :class:`Decider` and sends what :meth:`Decider.ready` returns; it never
asks which decider it holds.

* :class:`LatestDecider` (``decide="latest"``, the default) judges a rank the moment its report
  arrives, against the latest report of every other member (:func:`~popmesh.population.judge`),
  and dispatches a decision for that one rank at once: nobody waits for the slowest. Its
  bookkeeping is :class:`LatestBook`: each member's latest :class:`~popmesh.population.Report`, the
  judge's state, and at most one decision in flight **per replaced rank** (until that rank
  acknowledges it or reports with the weights it brought). A report of weights that a decision in
  flight is replacing (an older generation) neither is judged nor counts for anyone.
* :class:`CompleteDecider` (``decide="complete"``: torchgfn's protocol, kept for
  :mod:`popmesh.compat.spawn_policy`) waits until every member has reported an iteration, then runs
  :func:`~popmesh.population.decide` over all of them (the protocol module's ``CoordinatorBook``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from popmesh.population.decisions.latest import (
    LatestRules,
    LatestState,
    Report,
    Verdict,
    init_latest,
    judge,
    verdict_decision,
)
from popmesh.population.decisions.options import SelectiveOptions
from popmesh.population.decisions.selection import state_from_json, state_to_json, update_state
from popmesh.population.mechanisms.asynchronous.protocol import (
    ACK,
    BYE,
    METRIC,
    CoordinatorBook,
    Up,
    check_fingerprint,
    decision_messages,
)

__all__ = ["Dispatch", "Decider", "LatestBook", "LatestDecider", "CompleteDecider"]


class Dispatch(NamedTuple):
    """One decision to send: the iteration it names and the JSON for each group rank it involves."""

    iteration: int
    messages: dict[int, dict[str, Any]]
    replaced: tuple[int, ...]


class Decider(Protocol):
    """What the coordinator asks of a decision protocol (group ranks throughout)."""

    byes: set[int]

    def record(self, rank: int, up: Up, now: float) -> None:
        """Book one up row of group rank ``rank``."""

    def ready(self) -> list[Dispatch]:
        """The decisions to send now (each returned once)."""

    def finished(self) -> bool:
        """Every member said BYE and no decision is in flight: send FIN."""

    def stalled(self, now: float, timeout: float) -> tuple[int, list[int]] | None:
        """``(iteration, ranks)`` that the protocol waits for longer than ``timeout``, if any."""

    def missing_acks(self) -> list[int]:
        """Replaced ranks that have not acknowledged their decision."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON values)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Start from :meth:`state_dict`."""


@dataclass
class LatestBook:
    """Each member's latest report, :func:`judge`'s state, and the decision in flight per replaced rank.

    :meth:`record` books one up row and returns the verdict when it was a report that replaces its
    rank. Ranks are group ranks (0..n-1).
    """

    n: int
    rules: LatestRules = field(default_factory=LatestRules)
    reports: dict[int, Report] = field(default_factory=dict)
    in_flight: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (decision iteration, generation)
    byes: set[int] = field(default_factory=set)
    fingerprints: dict[int, int] = field(default_factory=dict)
    judged: int = 0
    state: LatestState = field(init=False)

    def __post_init__(self) -> None:
        self.state = init_latest(self.n)

    def record(self, rank: int, up: Up) -> Verdict | None:
        """Book ``up`` from ``rank``; judge it when it is a report of the rank's current weights and no
        decision for the rank is in flight. The replacing verdict, else None."""
        self._acknowledge(rank, up.iteration if up.kind == ACK else up.acked)
        if up.kind == BYE:
            self.byes.add(rank)
        if up.kind != METRIC:
            return None
        check_fingerprint(self.fingerprints, rank, up.fingerprint)
        report = Report(rank, up.iteration, max(up.steps, 0), up.metric, generation=up.generation)
        self.reports[rank] = report
        flying = self.in_flight.get(rank)
        if flying is not None and up.generation >= flying[1]:  # it reports the weights it was given
            del self.in_flight[rank]
        if rank in self.in_flight or rank in self.byes or up.generation < self.state.generations[rank]:
            return None
        verdict, self.state = judge(rank, list(self.reports.values()), self.state, self.rules)
        self.judged += 1
        if verdict.replace:
            self._dispatched(rank, up.iteration, up.generation + 1)
        return verdict

    def _dispatched(self, rank: int, iteration: int, generation: int) -> None:
        """From now on ``rank``'s reports of its old weights (an older generation) are stale."""
        self.in_flight[rank] = (iteration, generation)
        gens = list(self.state.generations)
        gens[rank] = generation
        self.state = self.state._replace(generations=tuple(gens))

    def _acknowledge(self, rank: int, acked: int) -> None:
        if rank in self.in_flight and acked >= self.in_flight[rank][0]:
            del self.in_flight[rank]

    def iterations(self, ranks: Mapping[int, Any]) -> list[int | None]:
        """Each member's latest report's iteration if it is among ``ranks`` (index = group rank)."""
        return [self.reports[r].iteration if r in ranks and r in self.reports else None for r in range(self.n)]

    def finished(self) -> bool:
        return len(self.byes) == self.n and not self.in_flight

    def missing_acks(self) -> list[int]:
        return sorted(self.in_flight)


class LatestDecider:
    """``decide="latest"``: a decision for one rank as soon as its report replaces it."""

    def __init__(self, n: int, options: SelectiveOptions, rules: LatestRules) -> None:
        self.book = LatestBook(n, rules)
        self.options = options
        self.byes = self.book.byes
        self._out: list[Dispatch] = []

    def record(self, rank: int, up: Up, now: float) -> None:
        verdict = self.book.record(rank, up)
        if verdict is None or not verdict.replace:
            return
        decision = verdict_decision(verdict, self.book.n, self.options.strategy, self.options.optimizer_policy,
                                    iteration=up.iteration)
        metrics = [verdict.objectives.get(r, math.nan) for r in range(self.book.n)]
        messages = decision_messages(decision, metrics, self.book.iterations(verdict.objectives))
        self._out.append(Dispatch(up.iteration, messages, decision.replaced))

    def ready(self) -> list[Dispatch]:
        out, self._out = self._out, []
        return out

    def finished(self) -> bool:
        return self.book.finished()

    def stalled(self, now: float, timeout: float) -> tuple[int, list[int]] | None:
        return None  # it never waits for a member's report

    def missing_acks(self) -> list[int]:
        return self.book.missing_acks()

    def state_dict(self) -> dict[str, Any]:
        return {}  # the history refills from the next reports; generations start afresh with the policy

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class CompleteDecider:
    """``decide="complete"``: every member reports iteration t, then one :func:`decide` over all of them."""

    def __init__(self, n: int, options: SelectiveOptions) -> None:
        self.book = CoordinatorBook(n)
        self.options = options
        self.state = options.init_state(n)
        self.byes = self.book.byes

    def record(self, rank: int, up: Up, now: float) -> None:
        self.book.record(up.kind, rank, up.iteration, up.metric, up.fingerprint, now=now, acked=up.acked)

    def ready(self) -> list[Dispatch]:
        ready = self.book.next_decision()
        if ready is None:
            return []
        iteration, metrics = ready
        decision = self.options.decide(metrics, iteration, self.state)
        self.state = update_state(self.state, decision.replaced, iteration)
        if not decision.replaced:
            return []
        self.book.dispatched(decision.replaced, iteration)
        messages = decision_messages(decision, metrics, [iteration] * self.book.n)
        return [Dispatch(iteration, messages, decision.replaced)]

    def finished(self) -> bool:
        return self.book.finished()

    def stalled(self, now: float, timeout: float) -> tuple[int, list[int]] | None:
        return self.book.stalled(now, timeout)

    def missing_acks(self) -> list[int]:
        return self.book.missing_acks()

    def state_dict(self) -> dict[str, Any]:
        return {"selection": state_to_json(self.state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("selection") is not None:
            self.state = state_from_json(state["selection"])
