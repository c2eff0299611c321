"""Decisions that never wait: a rank at its decision point is judged against every member's latest report.

Nobody waits for the slowest member (Ray Tune's asynchronous PBT; IsaacGymEnvs' decentralised
DexPBT): each member reports ``(rank, iteration, steps, objective, hparams)`` whenever it likes, and a
rank that reaches a decision point calls :func:`judge` with the latest report of every member it has.
The :class:`Verdict` says whether that one rank is replaced, by which donors, and why.

The rules, each an option of :class:`LatestRules`:

* **quantile fraction**: the bottom ``quantile_fraction`` of the comparable members may be replaced,
  by donors from the top ``quantile_fraction`` (Ray PBT's rule: ``ceil(n * f)``, at most ``n // 2``);
* **experience matching**: a member is compared only through its reports at equal or less experience
  than the judged rank's (DexPBT), so a rank that ran ahead is not judged against a slow one's future;
* **interval best**: a member counts with its best objective over the last ``interval`` of experience
  rather than its last value (DexPBT), so a random dip does not get it replaced;
* **two gaps**: a donor must lead by more than ``absolute_gap`` **and** by more than
  ``relative_gap * |donor's objective|`` (Sample Factory's pair, with the absolute value so that
  negative objectives work);
* **cooldown** and **burn-in**: no replacement before ``burn_in``, nor within ``cooldown`` of the
  rank's previous replacement;
* **exclusion**: ranks the heartbeat named (passed in) are neither compared nor donors;
* **reference**: a reference agent (passed in) is never replaced, compared or a donor: it trains
  alone, so that a run shows what the population bought.

Ties follow :mod:`~popmesh.population.decisions.selection`'s total order: among equal objectives the
higher rank is the worse. A donor's weights are its current ones; matching decides only who is
compared. The state (:class:`LatestState`) is explicit, passed in and returned; pure, no process.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.combine import OptimizerPolicy, Strategy, averaging_weights, optimizer_action
from popmesh.population.decisions.decision import Decision, _summary
from popmesh.population.decisions.selection import _is_real

__all__ = ["Report", "LatestRules", "LatestState", "Verdict", "init_latest", "judge", "verdict_decision",
           "latest_to_json", "latest_from_json"]

_SLACK = 1e-9  # so that ceil(10 * 0.3) is 3, not 4

Entry = tuple[float, float]
"""One point of a member's history: (clock, objective)."""


def _count(value: Any) -> bool:
    return _is_real(value) and float(value) == int(value) and value >= 0


@dataclass(frozen=True)
class Report:
    """What a member last said of itself; a bad field is a ConfigError naming the rank.

    * ``rank``: its position in the population (0..n-1: the group rank).
    * ``iteration``, ``steps``: its training iteration and the experience it collected (env steps),
      both non-negative and non-decreasing from one report to the next.
    * ``objective``: what selection ranks by, higher is better (the true objective: evaluation return,
      modes found), finite.
    * ``metric``: the training metric when it differs (for logs; it never ranks).
    * ``hparams``: its hyper-parameters, handed to the verdict of a rank it donates to.
    * ``generation``: how many times it was replaced; a higher one starts its history afresh.
    """

    rank: int
    iteration: int
    steps: int
    objective: float
    metric: float | None = None
    hparams: Mapping[str, Any] = field(default_factory=dict)
    generation: int = 0

    def __post_init__(self) -> None:
        if not _count(self.rank):
            raise ConfigError(f"Report.rank must be a non-negative int, got {self.rank!r}")
        for name in ("iteration", "steps", "generation"):
            if not _count(getattr(self, name)):
                raise ConfigError(f"rank {self.rank}'s report: {name} must be a non-negative int, "
                                  f"got {getattr(self, name)!r}")
        if not _is_real(self.objective) or not math.isfinite(self.objective):
            raise ConfigError(f"rank {self.rank} reported the objective {self.objective!r}: it must be a finite "
                              "number (report a diverged agent's last finite value, or leave it out)")
        if self.metric is not None and not _is_real(self.metric):
            raise ConfigError(f"rank {self.rank}'s report: metric must be a number or None, got {self.metric!r}")


def _non_negative(rules: Any, name: str, what: str) -> None:
    value = getattr(rules, name)
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"LatestRules.{name} must be a finite number >= 0 ({what}), got {value!r}")


@dataclass(frozen=True)
class LatestRules:
    """The options of :func:`judge`; each default's source follows it.

    Experience (``interval``, ``cooldown``, ``burn_in``, matching) is counted on ``clock``: the
    reports' ``steps`` or their ``iteration``.
    """

    quantile_fraction: float = 0.25
    """Bottom fraction replaced, donors from the top one, in (0, 0.5]: Ray Tune PBT's default."""
    relative_gap: float = 0.1
    """A donor's lead must exceed this fraction of its objective's magnitude: Sample Factory's default."""
    absolute_gap: float = 1e-6
    """A donor's lead must exceed this: Sample Factory's default (any real lead)."""
    clock: Literal["steps", "iterations"] = "steps"
    """What experience is counted in: env steps, as DexPBT and Sample Factory count it."""
    match_experience: bool = True
    """Compare only with reports at equal or less experience: DexPBT's rule."""
    interval: float = 0.0
    """Best objective over this much experience; 0 is the last value (Ray PBT; DexPBT: its period)."""
    cooldown: float = 0.0
    """Experience after a replacement before the next: 0, the cadence alone, as in Ray PBT."""
    burn_in: float = 0.0
    """Experience before the first replacement: Ray PBT's ``burn_in_period`` default."""
    count_absent: bool = False
    """True: members with no comparable report yet (a slower rank before its first report) count in
    the quantile, below the judged agent, so nobody is judged bottom on part of the population; False
    (the default, Ray PBT's way with trials that have no result yet) judges among the members heard
    from. On the demo's CartPole population True delayed the first replacements without saving steps."""
    max_donors: int | None = None
    """At most this many donors, the best first; None is all of them: popmesh's mean of donors."""
    history: int = 32
    """Entries kept per member for matching and interval best: enough for 32 reports of lead."""

    def __post_init__(self) -> None:
        f = self.quantile_fraction
        if not _is_real(f) or not 0.0 < f <= 0.5:
            raise ConfigError(f"LatestRules.quantile_fraction must be in (0, 0.5], got {f!r}: above 0.5 the bottom "
                              "and top fractions overlap and every agent could be replaced")
        if self.clock not in ("steps", "iterations"):
            raise ConfigError(f"LatestRules.clock must be 'steps' or 'iterations', got {self.clock!r}")
        _non_negative(self, "relative_gap", "a fraction of the donor's objective, e.g. 0.1")
        _non_negative(self, "absolute_gap", "in the objective's units")
        for name in ("interval", "cooldown", "burn_in"):
            _non_negative(self, name, f"in {self.clock}")
        for name in ("match_experience", "count_absent"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"LatestRules.{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_donors is not None and (not _count(self.max_donors) or self.max_donors < 1):
            raise ConfigError(f"LatestRules.max_donors must be a positive int or None, got {self.max_donors!r}")
        if not _count(self.history) or self.history < 1:
            raise ConfigError(f"LatestRules.history must be a positive int (entries per member), got {self.history!r}")

    @classmethod
    def build(cls, options: Mapping[str, Any]) -> LatestRules:
        """``LatestRules(**options)``, with a ConfigError naming the valid options for an unknown one."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(f"LatestRules got unknown options {unknown}; valid: {valid}")
        return cls(**options)

    def clock_of(self, report: Report) -> float:
        """The report's experience on this clock."""
        return float(report.steps if self.clock == "steps" else report.iteration)


class LatestState(NamedTuple):
    """What :func:`judge` remembers, per member (index = rank): its recent (clock, objective) entries,
    oldest first; the newest generation seen; the clock at which a verdict here last replaced it."""

    history: tuple[tuple[Entry, ...], ...]
    generations: tuple[int, ...]
    last_replaced: tuple[float | None, ...]


def init_latest(n: int) -> LatestState:
    """Fresh state for a population of ``n``."""
    if not _count(n) or n < 1:
        raise ConfigError(f"init_latest needs a positive number of members, got {n!r}")
    return LatestState(((),) * int(n), (0,) * int(n), (None,) * int(n))


def latest_to_json(state: LatestState) -> dict[str, Any]:
    """``state`` as JSON values, for a checkpoint: each member's entries and last replacement."""
    return {"history": [[list(e) for e in entries] for entries in state.history],
            "last_replaced": list(state.last_replaced)}


def latest_from_json(data: Mapping[str, Any], n: int) -> LatestState:
    """The state :func:`latest_to_json` wrote, for a population of ``n``; generations start at 0 (they
    count replacements within one run of the policy). ConfigError for a checkpoint of another size."""
    history, last = data.get("history"), data.get("last_replaced")
    if not isinstance(history, list) or not isinstance(last, list) or not len(history) == len(last) == n:
        size = len(history) if isinstance(history, list) else "?"
        raise ConfigError(f"the latest rules' checkpoint holds {size} members, this population has {n}: resume "
                          "a checkpoint of the same population")
    entries = tuple(tuple((float(c), float(v)) for c, v in member) for member in history)
    return LatestState(entries, (0,) * n, tuple(None if t is None else float(t) for t in last))


@dataclass(frozen=True)
class Verdict:
    """Whether ``rank`` is replaced, by which ``donors`` (ascending; empty when not), and why.

    ``objectives`` holds the value each compared member was judged by (the judged rank's included);
    ``donor_hparams`` each donor's reported hyper-parameters.
    """

    rank: int
    replace: bool
    donors: tuple[int, ...]
    reason: str
    objectives: dict[int, float] = field(default_factory=dict)
    donor_hparams: dict[int, Mapping[str, Any]] = field(default_factory=dict)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _observe(state: LatestState, reports: Mapping[int, Report], rules: LatestRules) -> LatestState:
    """The state with each report's entry appended; a stale report (older clock or generation, or
    from before this rank's recorded replacement) adds nothing, the same clock overwrites."""
    history, gens = list(state.history), list(state.generations)
    for r, report in reports.items():
        clock = rules.clock_of(report)
        if report.generation < gens[r]:
            continue
        if report.generation > gens[r]:
            history[r], gens[r] = (), report.generation
        replaced_at = state.last_replaced[r]
        if replaced_at is not None and clock <= replaced_at:
            continue
        entries = tuple(e for e in history[r] if replaced_at is None or e[0] > replaced_at)  # the new weights' own
        if entries and clock < entries[-1][0]:
            continue
        kept = entries[:-1] if entries and clock == entries[-1][0] else entries
        history[r] = (kept + ((clock, float(report.objective)),))[-rules.history:]
    return state._replace(history=tuple(history), generations=tuple(gens))


def _value(entries: tuple[Entry, ...], anchor: float, interval: float) -> tuple[float, float] | None:
    """(clock, value) of a member at experience ``anchor``: its newest entry at or below it, valued at
    the best objective over the ``interval`` before that entry; None without such an entry."""
    below = [e for e in entries if e[0] <= anchor]
    if not below:
        return None
    at = below[-1][0]
    return at, max(obj for clock, obj in below if clock >= at - interval)


def _checked(rank: int, reports: Sequence[Report], state: LatestState, rules: LatestRules,
             excluded: Collection[int]) -> tuple[dict[int, Report], frozenset[int]]:
    if not isinstance(rules, LatestRules):
        raise ConfigError(f"rules must be a LatestRules, got {type(rules).__name__}")
    if not isinstance(state, LatestState) or not len(state.generations) == len(state.last_replaced) == len(
            state.history):
        raise ConfigError("state must be the LatestState that init_latest(n) made and judge returned")
    n = len(state.history)
    by_rank: dict[int, Report] = {}
    for report in reports:
        if not isinstance(report, Report):
            raise ConfigError(f"reports must be Report values, got {type(report).__name__}")
        if report.rank >= n:
            raise ConfigError(f"rank {report.rank} reported, outside the population 0..{n - 1}")
        if report.rank in by_rank:
            raise ConfigError(f"rank {report.rank} has two reports: pass each member's latest one only")
        by_rank[int(report.rank)] = report
    if not _count(rank) or int(rank) not in by_rank:
        raise ConfigError(f"rank {rank!r} is judged without its own report among reports: pass its latest one")
    return by_rank, _ranks_of(excluded, n)


def _ranks_of(ranks: Collection[int], n: int) -> frozenset[int]:
    """``ranks`` (excluded or reference ones) as a set, each checked to lie in 0..n-1."""
    out = frozenset(int(r) for r in ranks)
    if any(not 0 <= r < n for r in out):
        raise ConfigError(f"excluded or reference names ranks {sorted(r for r in out if not 0 <= r < n)} outside "
                          f"0..{n - 1}")
    return out


def _hold(rank: int, clock: float, state: LatestState, rules: LatestRules, gone: frozenset[int],
          reference: frozenset[int] = frozenset()) -> str | None:
    """Why ``rank`` cannot be replaced now whoever leads, or None."""
    unit = rules.clock
    if rank in reference:
        return f"rank {rank} is the reference agent (never replaced)"
    if rank in gone:
        return f"rank {rank} is excluded (named by the heartbeat)"
    if clock < rules.burn_in:
        return f"burn-in: {_fmt(clock)} of {_fmt(rules.burn_in)} {unit}"
    last = state.last_replaced[rank]
    if last is not None and clock - last < rules.cooldown:
        return (f"cooldown: replaced at {_fmt(last)} {unit}, not again before {_fmt(last + rules.cooldown)} "
                f"(now {_fmt(clock)})")
    return None


def _leads(own: float, donor: float, rules: LatestRules) -> bool:
    lead = donor - own
    return lead > rules.absolute_gap and lead > rules.relative_gap * abs(donor)


def judge(rank: int, reports: Sequence[Report], state: LatestState, rules: LatestRules | None = None, *,
          excluded: Collection[int] = (), reference: Collection[int] = (),
          donors_from: Collection[int] | None = None) -> tuple[Verdict, LatestState]:
    """Judge ``rank`` against the latest report of every member; return the verdict and the new state.

    ``reports`` holds at most one report per member (its latest), ``rank``'s own included; what
    earlier calls saw is in ``state`` and counts too, and a member that never reported is not
    compared. ``excluded`` are ranks the heartbeat named: ignored, never waited for; ``reference``
    ranks are reference agents, never replaced and never compared or donors. The state takes
    every report's entry; a replacement also records the rank's clock. Its entries up to then belonged
    to the weights it loses: they never count for it again, but stand for it in the others'
    comparisons until it reports with its new weights (as Ray PBT keeps an exploited trial's last
    score), so that one replacement does not move the next member into the bottom quantile.
    ``donors_from``: the members that can donate now (None: all); the others still compare (a
    coordinator that resumed its state from a checkpoint passes those heard from since: a member
    known from the state alone has no weights to stream yet). Same inputs, same verdict.
    """
    rules = LatestRules() if rules is None else rules
    by_rank, gone = _checked(rank, reports, state, rules, excluded)
    kept = _ranks_of(reference, len(state.history))
    rank = int(rank)
    state = _observe(state, by_rank, rules)
    clock = rules.clock_of(by_rank[rank])
    held = _hold(rank, clock, state, rules, gone, kept)
    gone |= kept
    if held is not None:
        return Verdict(rank, False, (), f"not replaced: {held}"), state
    anchor = clock if rules.match_experience else math.inf
    values: dict[int, float] = {}
    last = state.last_replaced[rank]
    for r, entries in enumerate(state.history):
        if r == rank and last is not None:
            entries = tuple(e for e in entries if e[0] > last)
        found = None if r in gone else _value(entries, clock if r == rank else anchor, rules.interval)
        if found is not None:
            values[r] = found[1]
    if rank not in values:
        return Verdict(rank, False, (), "not replaced: no report of its own since its last replacement"), state
    if len(values) < 2:
        why = f"not replaced: no other member has a report at or below {_fmt(clock)} {rules.clock}"
        return Verdict(rank, False, (), why, values), state
    members = sum(1 for r in range(len(state.history)) if r not in gone) if rules.count_absent else len(values)
    able = None if donors_from is None else frozenset(int(r) for r in donors_from)
    return _rank_and_choose(rank, values, by_rank, state, rules, members, able)


def _rank_and_choose(rank: int, values: dict[int, float], by_rank: Mapping[int, Report], state: LatestState,
                     rules: LatestRules, members: int,
                     able: frozenset[int] | None = None) -> tuple[Verdict, LatestState]:
    """The quantile and gap rules over the comparable ``values``, in a population of ``members`` (the
    ones without a value count below ``rank``)."""
    n = len(values)
    best_first = sorted(values, key=lambda r: (-values[r], r))
    k = min(max(1, math.ceil(members * rules.quantile_fraction - _SLACK)), members // 2)
    place = best_first.index(rank) + 1
    own = values[rank]
    if place <= members - k:
        absent = f" ({members - n} member(s) not compared yet count below it)" if members > n else ""
        why = f"not replaced: objective {_fmt(own)} is {_ordinal(place)} of {members}, above the bottom {k}{absent}"
        return Verdict(rank, False, (), why, values), state
    top = best_first[:k]
    chosen = [d for d in top if (able is None or d in able) and _leads(own, values[d], rules)][:rules.max_donors]
    if not chosen and able is not None and not able & set(top):
        why = (f"not replaced: bottom {k} of {members} (objective {_fmt(own)}), but no top-{k} member can donate "
               "yet (none has reported since this state was resumed)")
        return Verdict(rank, False, (), why, values), state
    if not chosen:
        lead = values[top[0]] - own
        why = (f"not replaced: bottom {k} of {members} (objective {_fmt(own)}), but no top-{k} member leads by both "
               f"gaps: rank {top[0]} leads by {_fmt(lead)}, needs > {_fmt(rules.absolute_gap)} and > "
               f"{_fmt(rules.relative_gap * abs(values[top[0]]))}")
        return Verdict(rank, False, (), why, values), state
    donors = tuple(sorted(chosen))
    why = (f"replaced: objective {_fmt(own)} is {_ordinal(place)} of {members} (bottom {k}); donors {list(donors)} "
           f"lead by more than {_fmt(rules.absolute_gap)} and {_fmt(rules.relative_gap)} of their objective")
    hparams = {d: by_rank[d].hparams if d in by_rank else {} for d in donors}
    last = tuple(rules.clock_of(by_rank[rank]) if r == rank else t for r, t in enumerate(state.last_replaced))
    return Verdict(rank, True, donors, why, values, hparams), state._replace(last_replaced=last)


def _ordinal(place: int) -> str:
    suffix = "th" if 10 <= place % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(place % 10, "th")
    return f"{place}{suffix}"


def verdict_decision(verdict: Verdict, n: int, strategy: str | Strategy = Strategy.MEAN,
                     optimizer_policy: str | OptimizerPolicy = OptimizerPolicy.RESET,
                     iteration: int | None = None) -> Decision:
    """The :class:`~popmesh.population.Decision` that carries out a replacing ``verdict`` in a
    population of ``n``: its rank alone replaced, its donors weighted by ``strategy`` over the
    objectives it was judged by (``best_only``: the best donor; ``reset_weights``: no donor), the
    optimizer source of ``optimizer_policy``; ``iteration`` is the judged report's."""
    if not verdict.replace:
        raise ConfigError(f"rank {verdict.rank}'s verdict replaces nobody ({verdict.reason}): nothing to carry out")
    strategy, policy = Strategy.parse(strategy), OptimizerPolicy.parse(optimizer_policy)
    r = verdict.rank
    donors: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    if strategy is not Strategy.RESET:
        m = [verdict.objectives.get(i, math.nan) for i in range(n)]
        donors, weights = tuple(verdict.donors), averaging_weights(m, verdict.donors, strategy)
        if strategy is Strategy.BEST_ONLY:
            donors, weights = tuple(d for d, w in zip(donors, weights) if w > 0), (1.0,)
    source = optimizer_action(policy, r, donors, weights, metrics=[verdict.objectives.get(i, math.nan)
                                                                    for i in range(n)]) if donors else None
    return Decision((r,), {r: donors}, {r: weights}, {r: source}, strategy, policy, reasons={r: verdict.reason},
                    iteration=iteration, summary=_summary(n, [r], {}, strategy))
