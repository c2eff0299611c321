"""One replacement decision: who is replaced, by which donors, with which weights, and the optimizer action.

:func:`decide` is the single pure entry point a policy calls (on a coordinator, or on every rank
with the same inputs and seed). Its :class:`Decision` is a frozen value that converts to and from
plain JSON (:meth:`Decision.to_dict`), so a coordinator can send it as a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.core.errors import ConfigError
from popmesh.population.combine import (
    DEFAULT_OPTIMIZER_POLICY,
    OptimizerPolicy,
    Strategy,
    averaging_weights,
    optimizer_action,
)
from popmesh.population.selection import (
    DonorRule,
    ReplacementRule,
    RngLike,
    SelectionState,
    as_generator,
    as_metrics,
    combine_rules,
    donors_from_pool,
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
        put(self, "donors", {r: tuple(int(d) for d in v) for r, v in donors.items()})
        put(self, "weights", {r: tuple(float(w) for w in v) for r, v in weights.items()})
        put(self, "copy_optimizer_from", {r: None if v is None else int(v) for r, v in
                                          _int_keys(self.copy_optimizer_from, "copy_optimizer_from").items()})
        put(self, "reasons", {r: str(v) for r, v in _int_keys(self.reasons, "reasons").items()})
        put(self, "skipped", {r: str(v) for r, v in _int_keys(self.skipped, "skipped").items()})
        put(self, "strategy", Strategy.parse(self.strategy).value)
        put(self, "optimizer_policy", OptimizerPolicy.parse(self.optimizer_policy).value)
        self._check()

    def _check(self) -> None:
        rep = set(self.replaced)
        if len(rep) != len(self.replaced):
            raise ConfigError(f"Decision.replaced has duplicates: {self.replaced}")
        for name in ("donors", "weights", "copy_optimizer_from"):
            if set(getattr(self, name)) != rep:
                raise ConfigError(f"Decision.{name} must have exactly one entry per replaced rank "
                                  f"{sorted(rep)}, got {sorted(getattr(self, name))}")
        if rep & set(self.skipped):
            raise ConfigError(f"ranks {sorted(rep & set(self.skipped))} are both replaced and skipped")
        for r in self.replaced:
            donors, weights = self.donors[r], self.weights[r]
            if len(donors) != len(weights) or rep & set(donors):
                raise ConfigError(f"rank {r}: donors {donors} must not be replaced and need one weight each, "
                                  f"got weights {weights}")
            if donors and (min(weights) < 0 or abs(sum(weights) - 1.0) > 1e-6):
                raise ConfigError(f"rank {r}: weights {weights} must be non-negative and sum to 1")
            if self.copy_optimizer_from[r] is not None and self.copy_optimizer_from[r] not in donors:
                raise ConfigError(f"rank {r} copies optimizer state from {self.copy_optimizer_from[r]}, "
                                  f"which is not one of its donors {donors}")

    @property
    def donor_ranks(self) -> tuple[int, ...]:
        """Every rank that donates to at least one replaced rank, ascending."""
        return tuple(sorted({d for ds in self.donors.values() for d in ds}))

    def recipients(self, rank: int) -> tuple[int, ...]:
        """The replaced ranks that need ``rank``'s weights (empty if ``rank`` donates to nobody)."""
        return tuple(r for r in self.replaced if rank in self.donors[r])

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


def _plan_one(m: np.ndarray, r: int, pool: list[int], donor_rule: DonorRule, strategy: Strategy,
              policy: OptimizerPolicy, gen: np.random.Generator | None,
              weights_of: dict[tuple[int, ...], tuple[float, ...]]) -> _Plan:
    """Donors, weights and optimizer source of replaced rank ``r``; empty donors when none is valid.
    ``pool``: the valid donors, best first; ``weights_of`` caches weights per donor set (most replaced
    ranks of a decision share theirs)."""
    if strategy is Strategy.RESET:
        return (), (), None
    donors = donors_from_pool(pool, donor_rule, gen)
    if not donors:
        return (), (), None
    key = tuple(donors)
    if key not in weights_of:
        weights_of[key] = tuple(averaging_weights(m, donors, strategy))
    weights: tuple[float, ...] = weights_of[key]
    if strategy is Strategy.BEST_ONLY:
        donors = [d for d, w in zip(donors, weights) if w > 0]
        weights = (1.0,)
    return tuple(donors), tuple(weights), optimizer_action(policy, r, donors, weights, metrics=m)


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
    replaced, donors, weights, copy_from, skipped = [], {}, {}, {}, {}
    pool = valid_donors(m, selected)
    weights_of: dict[tuple[int, ...], tuple[float, ...]] = {}
    for r in selected:
        ds, ws, opt = _plan_one(m, r, pool, donor_rule, strategy, policy, gen, weights_of)
        if not ds and strategy is not Strategy.RESET:
            skipped[r] = _NO_DONOR
            continue
        replaced.append(r)
        donors[r], weights[r], copy_from[r] = ds, ws, opt
    return Decision(tuple(replaced), donors, weights, copy_from, strategy.value, policy.value,
                    reasons={r: why[r] for r in replaced}, skipped=skipped, iteration=iteration,
                    summary=_summary(len(m), replaced, skipped, strategy))


def _summary(n: int, replaced: list[int], skipped: dict[int, str], strategy: Strategy) -> str:
    if replaced:
        text = f"replace {len(replaced)} of {n} agents {replaced} by {strategy.value}"
    elif skipped:
        text = "no replacement: no valid donor"
    else:
        text = "no replacement: no agent selected"
    return text + (f"; skipped {sorted(skipped)} (no valid donor)" if replaced and skipped else "")
