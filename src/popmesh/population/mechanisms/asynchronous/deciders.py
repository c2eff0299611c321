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
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from popmesh.population.decisions.hparams import assign, decode, encode
from popmesh.population.decisions.latest import (
    LatestRules,
    LatestState,
    Report,
    Verdict,
    init_latest,
    judge,
    latest_from_json,
    latest_to_json,
    verdict_decision,
)
from popmesh.population.decisions.options import Explore, SelectiveOptions
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

__all__ = ["Dispatch", "Decider", "LatestBook", "LatestDecider", "ReproducibleDecider", "CompleteDecider"]

_OBSERVATIONS = 1024  # PB2's data: the newest observations of progress kept (its fit takes a window of them)


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
    rank. Ranks are group ranks (0..n-1). With ``explore``, reports carry its keys' values, and two
    reports of one member's weights in a row make an observation of its progress (for PB2).
    """

    n: int
    rules: LatestRules = field(default_factory=LatestRules)
    explore: Explore | None = None
    reference: frozenset[int] = frozenset()  # reference agents: never replaced, compared or donors
    excluded: set[int] = field(default_factory=set)  # members the heartbeat named
    observations: deque[Any] = field(default_factory=lambda: deque(maxlen=_OBSERVATIONS))
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
        decision for the rank is in flight. The verdict, else None."""
        report = self.take(rank, up)
        return None if report is None else self.judge_rank(rank, report)

    def take(self, rank: int, up: Up) -> Report | None:
        """Book ``up`` from ``rank`` without judging; its report when it may be judged."""
        self._acknowledge(rank, up.iteration if up.kind == ACK else up.acked)
        if up.kind == BYE:
            self.byes.add(rank)
        if up.kind != METRIC:
            return None
        check_fingerprint(self.fingerprints, rank, up.fingerprint)
        hparams = decode(self.explore, up.hparams) if self.explore is not None else {}
        objective = up.objective if math.isfinite(up.objective) else up.metric
        report = Report(rank, up.iteration, max(up.steps, 0), objective, up.metric, hparams, up.generation)
        self._observe(self.reports.get(rank), report)
        self.reports[rank] = report
        flying = self.in_flight.get(rank)
        if flying is not None and up.generation >= flying[1]:  # it reports the weights it was given
            del self.in_flight[rank]
        if rank in self.in_flight or rank in self.byes or up.generation < self.state.generations[rank]:
            return None
        return report

    def judge_rank(self, rank: int, report: Report) -> Verdict:
        """:func:`judge` ``rank`` (whose latest report is ``report``) against every member's latest."""
        verdict, self.state = judge(rank, list(self.reports.values()), self.state, self.rules,
                                    excluded=self.excluded, reference=self.reference,
                                    donors_from=self.reports)  # after a resume the state knows more members
        self.judged += 1
        if verdict.replace:
            self._dispatched(rank, report.iteration, report.generation + 1)
        return verdict

    def _observe(self, before: Report | None, now: Report) -> None:
        """An observation of progress (PB2's data) from two reports of the same weights in a row."""
        if self.explore is None or self.explore.pb2 is None or before is None or not before.hparams:
            return
        start, end = self.rules.clock_of(before), self.rules.clock_of(now)
        if before.generation == now.generation and end > start:
            from popmesh.population.decisions.pb2 import Observation

            self.observations.append(Observation(start, end, before.hparams, now.objective - before.objective))

    def assigned(self, verdict: Verdict, seed: int, iteration: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a replaced rank trains at, and what it inherited: the best donor's values, explored."""
        best = max(verdict.donors, key=lambda d: (verdict.objectives.get(d, -math.inf), -d))
        inherited = dict(self.reports[best].hparams) if best in self.reports else {}
        pending = [r.hparams for g, r in self.reports.items()
                   if g != verdict.rank and g not in self.excluded and r.hparams]
        clock = self.rules.clock_of(self.reports[verdict.rank])
        return assign(inherited, self.explore, seed, iteration, verdict.rank, list(self.observations), clock,
                      pending), inherited

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

    def __init__(self, n: int, options: SelectiveOptions, rules: LatestRules,
                 reference: frozenset[int] = frozenset()) -> None:
        self.book = LatestBook(n, rules, options.explore, reference)
        self.options = options
        self.byes = self.book.byes
        self._out: list[Dispatch] = []

    def record(self, rank: int, up: Up, now: float) -> None:
        verdict = self.book.record(rank, up)
        if verdict is not None and verdict.replace:
            self._out.append(self._dispatch(verdict, up.iteration))

    def _dispatch(self, verdict: Verdict, iteration: int) -> Dispatch:
        """The messages that carry out a replacing ``verdict`` of the report of ``iteration``."""
        decision = verdict_decision(verdict, self.book.n, self.options.strategy, self.options.optimizer_policy,
                                    iteration=iteration)
        metrics = [verdict.objectives.get(r, math.nan) for r in range(self.book.n)]
        messages = decision_messages(decision, metrics, self.book.iterations(verdict.objectives))
        explore = self.options.explore
        if explore is not None and verdict.donors:
            values, inherited = self.book.assigned(verdict, self.options.seed, iteration)
            if values:
                messages[verdict.rank]["hparams"] = encode(explore, values).tolist()
                messages[verdict.rank]["inherited"] = encode(explore, inherited).tolist()
        return Dispatch(iteration, messages, decision.replaced)

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
        """Each member's recent entries and last replacement (cooldown, interval best and experience
        matching go on after a resume); generations start afresh with the policy."""
        return {"latest": latest_to_json(self.book.state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("latest") is not None:
            self.book.state = latest_from_json(state["latest"], self.book.n)


class ReproducibleDecider(LatestDecider):
    """``decide="latest"`` with a declared ``lag``: the same rules, in rounds keyed to iterations.

    Once every member (but those that said BYE) has reported iteration ``t``, all of round ``t``'s
    reports are booked, each member is judged in rank order against them, the decisions go out,
    and then every member gets a ``round`` notice: it applies what round ``t`` decided for it at
    its call of iteration ``t + lag``, waiting there if the round is not resolved yet. The same
    reports give the same decisions whatever order they arrive in: two runs with the same seeds
    on the same engine end bit-identical.
    """

    def __init__(self, n: int, options: SelectiveOptions, rules: LatestRules,
                 reference: frozenset[int] = frozenset()) -> None:
        super().__init__(n, options, rules, reference)
        self.rounds: dict[int, dict[int, Up]] = {}
        self.opened: dict[int, float] = {}

    def record(self, rank: int, up: Up, now: float) -> None:
        if up.kind == METRIC:
            self.rounds.setdefault(up.iteration, {})[rank] = up
            self.opened.setdefault(up.iteration, now)
        else:
            self.book.take(rank, up)  # an acknowledgement, or BYE (which may complete a round)
        self._close_rounds()

    def _close_rounds(self) -> None:
        """Decide every complete round, oldest first; a round waits for the ones before it."""
        for t in sorted(self.rounds):
            ups = self.rounds[t]
            if any(r not in ups and r not in self.byes for r in range(self.book.n)):
                return
            del self.rounds[t]
            self.opened.pop(t, None)
            judged = {r: self.book.take(r, ups[r]) for r in sorted(ups)}
            for r, report in judged.items():
                verdict = None if report is None else self.book.judge_rank(r, report)
                if verdict is not None and verdict.replace:
                    self._out.append(self._dispatch(verdict, t))
            notice = {"kind": "round", "iteration": t}
            self._out.append(Dispatch(t, {g: notice for g in range(self.book.n) if g not in self.byes}, ()))

    def stalled(self, now: float, timeout: float) -> tuple[int, list[int]] | None:
        for t in sorted(self.opened):
            missing = [r for r in range(self.book.n) if r not in self.rounds[t] and r not in self.byes]
            if now - self.opened[t] > timeout and missing:
                return t, missing
        return None


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
