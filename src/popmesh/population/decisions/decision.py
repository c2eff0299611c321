"""One replacement decision: who is replaced, by which donors, with which weights, and the optimizer action.

:func:`decide` is the single pure entry point a policy calls (on a coordinator, or on every rank
with the same inputs and seed). Its :class:`Decision` is a frozen value that converts to and from
plain JSON (:meth:`Decision.to_dict`), so a coordinator can send it as a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.combine import (
    DEFAULT_OPTIMIZER_POLICY,
    OptimizerPolicy,
    Strategy,
    _weights_of,
    optimizer_action,
)
from popmesh.population.decisions.selection import (
    DonorRule,
    ReplacementRule,
    RngLike,
    SelectionState,
    as_generator,
    as_metrics,
    combine_rules,
    donors_from_pool,
    draw_donor_rows,
    valid_donors,
)

__all__ = ["Decision", "decide"]

_FORMAT = 1
_NO_DONOR = "no valid donor: every other agent is being replaced or has a non-finite metric"


def _int_keys(d: Mapping[Any, Any], what: str) -> dict[int, Any]:
    try:
        return {int(k): v for k, v in d.items()}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Decision.{what} keys must be ranks (ints), got {list(d)}") from e


def _shared(d: dict[int, Any], fn: Any) -> dict[int, Any]:
    """``{k: fn(v)}``, calling ``fn`` once per distinct value object: :func:`decide` gives every
    replaced rank of a deterministic rule the same donor tuple, so normalising a decision that
    averages all others costs O(n), not O(n²). The values stay alive in ``d`` meanwhile, so an id
    names one object throughout."""
    done: dict[int, Any] = {}
    out = {}
    for k, v in d.items():
        key = id(v)
        if key not in done:
            done[key] = fn(v)
        out[k] = done[key]
    return out


def _int_tuple(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _float_tuple(v: Any) -> tuple[float, ...]:
    return tuple(float(x) for x in v)


@dataclass(frozen=True)
class Decision:
    """A replacement decision. Treat the dict fields as read-only.

    * ``replaced``: ascending ranks that get new weights this time.
    * ``donors[r]`` / ``weights[r]``: donor ranks of replaced rank ``r`` (ascending) and their
      weights (same order, sum 1); both empty for ``reset_weights`` (re-initialise from the builder).
    * ``copy_optimizer_from[r]``: donor rank whose optimizer state ``r`` copies, or None (see
      ``optimizer_policy``: rebuild for ``reset``, keep own for ``keep``).
    * ``reasons[r]``: why ``r`` was selected; ``skipped[r]``: why a selected rank was *not* replaced.
    * ``summary``: one line for logs.
    """

    replaced: tuple[int, ...]
    donors: dict[int, tuple[int, ...]]
    weights: dict[int, tuple[float, ...]]
    copy_optimizer_from: dict[int, int | None]
    strategy: str
    optimizer_policy: str = DEFAULT_OPTIMIZER_POLICY.value
    reasons: dict[int, str] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)
    iteration: int | None = None
    summary: str = ""

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "replaced", tuple(sorted(int(r) for r in self.replaced)))
        donors, weights = _int_keys(self.donors, "donors"), _int_keys(self.weights, "weights")
        put(self, "donors", _shared(donors, _int_tuple))
        put(self, "weights", _shared(weights, _float_tuple))
        put(self, "copy_optimizer_from", {r: None if v is None else int(v) for r, v in
                                          _int_keys(self.copy_optimizer_from, "copy_optimizer_from").items()})
        put(self, "reasons", {r: str(v) for r, v in _int_keys(self.reasons, "reasons").items()})
        put(self, "skipped", {r: str(v) for r, v in _int_keys(self.skipped, "skipped").items()})
        put(self, "strategy", Strategy.parse(self.strategy).value)
        put(self, "optimizer_policy", OptimizerPolicy.parse(self.optimizer_policy).value)
        self._check()

    def summary_in(self, ranks: Sequence[int]) -> str:
        """:attr:`summary` naming each agent by its global rank: the decision's ranks are positions in
        ``ranks`` (a group's global ranks). The same text when the group is the whole world, or when
        the summary is not the one :func:`decide` writes (a caller's own text is kept as it is)."""
        strategy = Strategy.parse(self.strategy)
        if (list(ranks) == list(range(len(ranks)))
                or self.summary != _summary(len(ranks), list(self.replaced), dict(self.skipped), strategy)):
            return self.summary
        return _summary(len(ranks), [ranks[r] for r in self.replaced], {ranks[r]: v for r, v in self.skipped.items()},
                        strategy)

    @classmethod
    def _normalised(cls, **fields: Any) -> Decision:
        """A Decision from fields that already have their final types (ascending int tuples, int
        keys, str values, parsed names), as :func:`decide` builds them: checked like any other, but
        without the per-entry conversions of ``__init__``, which cost more than the decision."""
        decision = cls.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(decision, name, value)
        decision._check()
        return decision

    def _check(self) -> None:
        rep = set(self.replaced)
        if len(rep) != len(self.replaced):
            raise ConfigError(f"Decision.replaced has duplicates: {self.replaced}")
        for name in ("donors", "weights", "copy_optimizer_from"):
            if getattr(self, name).keys() != rep:
                raise ConfigError(f"Decision.{name} must have exactly one entry per replaced rank "
                                  f"{sorted(rep)}, got {sorted(getattr(self, name))}")
        if not rep.isdisjoint(self.skipped):
            raise ConfigError(f"ranks {sorted(rep & set(self.skipped))} are both replaced and skipped")
        ranks = self._distinct_plans()
        if not self._plans_hold(rep, ranks):
            self._raise_on_bad_plan(rep, ranks)

    def _plans_hold(self, rep: set[int], ranks: tuple[int, ...]) -> bool:
        """Whether every plan of ``ranks`` is sound, with C-level maps and each distinct weight
        tuple checked once (random donors give 256 plans at 1,024 agents)."""
        donors = list(map(self.donors.__getitem__, ranks))
        weights = list(map(self.weights.__getitem__, ranks))
        sources = list(map(self.copy_optimizer_from.__getitem__, ranks))
        if list(map(len, donors)) != list(map(len, weights)) or not rep.isdisjoint(chain.from_iterable(donors)):
            return False
        distinct = dict(zip(map(id, weights), weights)).values()
        if not all(not w or (min(w) >= 0 and abs(sum(w) - 1.0) <= 1e-6) for w in distinct):
            return False
        return sources.count(None) == len(sources) or all(s is None or s in d for s, d in zip(sources, donors))

    def _raise_on_bad_plan(self, rep: set[int], ranks: tuple[int, ...]) -> None:
        """The ConfigError naming the first unsound plan of ``ranks``."""
        for r in ranks:
            donors, weights, source = self.donors[r], self.weights[r], self.copy_optimizer_from[r]
            if len(donors) != len(weights) or not rep.isdisjoint(donors):
                raise ConfigError(f"rank {r}: donors {donors} must not be replaced and need one weight each, "
                                  f"got weights {weights}")
            if donors and (min(weights) < 0 or abs(sum(weights) - 1.0) > 1e-6):
                raise ConfigError(f"rank {r}: weights {weights} must be non-negative and sum to 1")
            if source is not None and source not in donors:
                raise ConfigError(f"rank {r} copies optimizer state from {source}, "
                                  f"which is not one of its donors {donors}")

    def _distinct_plans(self) -> tuple[int, ...]:
        """The replaced ranks whose plan needs checking: only the first when every replaced rank
        shares one donor tuple, one weight tuple and one optimizer source (what :func:`decide`
        builds for a deterministic rule), else all. Counted with C-level maps, not a Python loop."""
        rs = self.replaced
        if (rs and len(set(map(id, self.donors.values()))) == 1 and len(set(map(id, self.weights.values()))) == 1
                and len(set(self.copy_optimizer_from.values())) == 1):
            return rs[:1]
        return rs

    @property
    def donor_ranks(self) -> tuple[int, ...]:
        """Every rank that donates to at least one replaced rank, ascending."""
        return tuple(sorted({d for ds in self.donors.values() for d in ds}))

    def recipients(self, rank: int) -> tuple[int, ...]:
        """The replaced ranks that need ``rank``'s weights (empty if ``rank`` donates to nobody)."""
        return tuple(r for r in self.replaced if rank in self.donors[r])

    def part(self, rank: int) -> Decision:
        """What ``rank`` needs to know of its own replacement: this decision reduced to ``rank``'s
        plan if it is replaced (else to no replacement), with the same strategy, iteration and
        summary. The asynchronous coordinator sends each rank its part, so a message stays O(donors)
        instead of O(replaced × donors) (see docs/scaling.md)."""
        mine = (rank,) if rank in self.donors else ()
        return Decision(mine, {r: self.donors[r] for r in mine}, {r: self.weights[r] for r in mine},
                        {r: self.copy_optimizer_from[r] for r in mine}, self.strategy, self.optimizer_policy,
                        reasons={r: self.reasons[r] for r in mine if r in self.reasons},
                        skipped={r: self.skipped[r] for r in (rank,) if r in self.skipped},
                        iteration=self.iteration, summary=self.summary)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (rank keys become strings); :meth:`from_dict` inverts it."""
        def keyed(d: Mapping[int, Any], fn: Any = lambda v: v) -> dict[str, Any]:
            return {str(k): fn(v) for k, v in sorted(d.items())}

        return {
            "format": _FORMAT, "iteration": self.iteration, "replaced": list(self.replaced),
            "donors": keyed(self.donors, list), "weights": keyed(self.weights, list),
            "copy_optimizer_from": keyed(self.copy_optimizer_from), "strategy": self.strategy,
            "optimizer_policy": self.optimizer_policy, "reasons": keyed(self.reasons),
            "skipped": keyed(self.skipped), "summary": self.summary,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """Rebuild a Decision from :meth:`to_dict` output (for example after a JSON round trip)."""
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ConfigError(f"not a popmesh Decision dict of format {_FORMAT} (got format {got!r})")
        try:
            required = ("replaced", "donors", "weights", "copy_optimizer_from", "strategy")
            fields = {k: data[k] for k in required}
        except KeyError as e:
            raise ConfigError(f"Decision dict lacks the field {e.args[0]!r}") from e
        optional = ("optimizer_policy", "reasons", "skipped", "iteration", "summary")
        return cls(**fields, **{k: data[k] for k in optional if k in data})


_Plan = tuple[tuple[int, ...], tuple[float, ...], int | None]
_NO_PLAN: _Plan = ((), (), None)


def _plan(m: np.ndarray, r: int, donors: list[int], strategy: Strategy, policy: OptimizerPolicy) -> _Plan:
    """Donors, weights and optimizer source of replaced rank ``r`` (empty when there is no donor).
    Only the donor set matters: the pool holds no replaced rank, so every replaced rank with the
    same donors gets the same plan."""
    if not donors:
        return _NO_PLAN
    # the pool's donors are distinct ranks with finite metrics: no need to check them again
    weights = _weights_of(m, np.fromiter(donors, dtype=np.intp, count=len(donors)), strategy)
    if strategy is Strategy.BEST_ONLY:
        donors = [d for d, w in zip(donors, weights) if w > 0]
        weights = (1.0,)
    source = optimizer_action(policy, r, donors, weights, metrics=m) if policy is OptimizerPolicy.COPY else None
    return tuple(donors), weights, source


def _plans(m: np.ndarray, selected: list[int], pool: list[int], donor_rule: DonorRule, strategy: Strategy,
           policy: OptimizerPolicy, gen: np.random.Generator | None) -> list[_Plan]:
    """One plan per selected rank. Deterministic rules give every replaced rank the same donor set,
    planned once and shared (the same tuples), so a decision costs O(n log n) whatever the rule;
    random donors are drawn per rank, in ascending rank order, from one sorted pool."""
    if strategy is Strategy.RESET:
        return [_NO_PLAN] * len(selected)
    if not selected:
        return []
    if donor_rule.kind != "random":
        return [_plan(m, selected[0], donors_from_pool(pool, donor_rule), strategy, policy)] * len(selected)
    assert donor_rule.k is not None  # DonorRule checked k for "random"
    return _random_plans(m, draw_donor_rows(sorted(pool), donor_rule.k, len(selected), gen), strategy, policy)


def _random_plans(m: np.ndarray, rows: np.ndarray, strategy: Strategy, policy: OptimizerPolicy) -> list[_Plan]:
    """The plans of drawn donor ``rows`` (one ascending row per replaced rank), vectorised: the
    same weights and optimizer sources :func:`_plan` gives row by row, without a Python call per
    rank (1,024 agents: 256 rows)."""
    count, k = rows.shape
    if k == 0:
        return [_NO_PLAN] * count
    dm = m[rows]
    best = rows[np.arange(count), np.argmax(dm, axis=1)]  # rows ascend: the first maximum is the lowest rank
    sources: list[int | None] = best.tolist() if policy is OptimizerPolicy.COPY else [None] * count
    if strategy is Strategy.BEST_ONLY:
        return [((b,), (1.0,), s) for b, s in zip(best.tolist(), sources)]
    donors = list(map(tuple, rows.tolist()))
    if strategy is Strategy.MEAN:
        weights = [(1.0 / k,) * k] * count
    else:  # weighted_mean: rank_weights per row (equal metrics share their mean rank)
        below = (dm[:, None, :] < dm[:, :, None]).sum(axis=2)
        equal = (dm[:, None, :] == dm[:, :, None]).sum(axis=2)
        ranks = below + (equal + 1) / 2.0
        weights = list(map(tuple, (ranks / ranks.sum(axis=1, keepdims=True)).tolist()))
    return list(zip(donors, weights, sources))


def decide(metrics: Sequence[float] | np.ndarray, rule: ReplacementRule, donor_rule: DonorRule | None = None,
           strategy: str | Strategy = Strategy.MEAN, *, iteration: int | None = None,
           state: SelectionState | None = None, rng: RngLike | None = None,
           optimizer_policy: str | OptimizerPolicy = DEFAULT_OPTIMIZER_POLICY) -> Decision:
    """Decide which agents to replace and how, from one metric per agent (higher is better).

    ``rule`` picks who is replaced (see :func:`combine_rules`); ``donor_rule`` (default: all valid
    others) picks each replaced agent's donors, never a replaced or non-finite agent; ``strategy``
    sets the weights. A selected agent without any valid donor is not replaced and appears in
    ``skipped`` (``reset_weights`` needs no donor). ``state`` carries cooldowns and ages between
    calls (advance it with :func:`update_state`); ``rng`` (seed or Generator) is needed for random
    donors, drawn for replaced ranks in ascending order. Same inputs and seed, same Decision.
    """
    m = as_metrics(metrics)
    strategy, policy = Strategy.parse(strategy), OptimizerPolicy.parse(optimizer_policy)
    donor_rule = DonorRule() if donor_rule is None else donor_rule
    needs_rng = donor_rule.kind == "random" and strategy is not Strategy.RESET
    gen = as_generator(rng, "random donors") if needs_rng else None
    selected, why = combine_rules(m, rule, iteration=iteration, state=state)
    plans = _plans(m, selected, valid_donors(m, selected), donor_rule, strategy, policy, gen)
    skipped = {} if strategy is Strategy.RESET else {r: _NO_DONOR for r, plan in zip(selected, plans) if not plan[0]}
    replaced = [r for r in selected if r not in skipped] if skipped else selected
    donors, weights, copy_from = _by_rank(replaced, [p for p in plans if p[0]] if skipped else plans)
    return Decision._normalised(
        replaced=tuple(replaced), donors=donors, weights=weights, copy_optimizer_from=copy_from,
        strategy=strategy.value, optimizer_policy=policy.value,
        reasons=why if not skipped else {r: why[r] for r in replaced}, skipped=skipped, iteration=iteration,
        summary=_summary(len(m), replaced, skipped, strategy))


def _by_rank(ranks: list[int], plans: list[_Plan]) -> tuple[dict[int, Any], dict[int, Any], dict[int, Any]]:
    """The donors, weights and optimizer sources of ``plans`` keyed by rank, built by C-level zips."""
    if not plans:
        return {}, {}, {}
    donors, weights, sources = zip(*plans)
    return dict(zip(ranks, donors)), dict(zip(ranks, weights)), dict(zip(ranks, sources))


def _summary(n: int, replaced: list[int], skipped: dict[int, str], strategy: Strategy) -> str:
    if replaced:
        text = f"replace {len(replaced)} of {n} agents {replaced} by {strategy.value}"
    elif skipped:
        text = "no replacement: no valid donor"
    else:
        text = "no replacement: no agent selected"
    return text + (f"; skipped {sorted(skipped)} (no valid donor)" if replaced and skipped else "")
