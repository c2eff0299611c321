"""What :class:`AsyncSelectiveAveraging`'s options mean for its deciders: the latest rules that its
``rule``, ``donor_rule`` and ``latest`` say together, and the checks of what ``decide="latest"``
alone does (a reference agent, PB2's explore). Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from popmesh.core.errors import ConfigError
from popmesh.population.decisions.latest import LatestRules
from popmesh.population.decisions.options import SelectiveOptions
from popmesh.population.decisions.selection import DonorRule, ReplacementRule

__all__ = ["latest_rules", "check_latest_only", "check_lag", "reference_in"]


def latest_rules(options: SelectiveOptions, latest: LatestRules | Mapping[str, Any] | None,
                 given: set[str]) -> LatestRules:
    """The judge's rules: ``latest`` (a LatestRules, or its fields over the defaults), with the quantile
    fraction and the most donors that ``rule`` and ``donor_rule`` say unless ``latest`` sets them;
    ConfigError naming a field that cannot hold, or that both set differently."""
    if latest is not None and not isinstance(latest, (LatestRules, Mapping)):
        raise ConfigError(f"latest must be a LatestRules or a mapping of its fields, got {type(latest).__name__}")
    def quantile() -> float:
        return _quantile_of(options.rule)

    def donors() -> int | None:
        return _max_donors_of(options.donor_rule)

    fields: dict[str, tuple[str, Callable[[], Any]]] = {"quantile_fraction": ("rule", quantile),
                                                        "max_donors": ("donor_rule", donors)}
    explicit = latest if isinstance(latest, LatestRules) else None
    mapping = dict(latest) if isinstance(latest, Mapping) else {}
    derived: dict[str, Any] = {}
    for name, (option, value_of) in fields.items():
        if (explicit is None and name not in mapping) or option in given:
            derived[name] = value_of()
        set_here = getattr(explicit, name) if explicit is not None else mapping.get(name, derived.get(name))
        if option in given and set_here != derived[name]:
            raise ConfigError(f"latest's {name}={set_here!r} disagrees with the {derived[name]!r} that {option}= "
                              "sets: set it in one place")
    return explicit if explicit is not None else LatestRules.build({**derived, **mapping})


def _quantile_of(rule: ReplacementRule) -> float:
    if rule.threshold is not None or rule.age_range is not None or rule.ratio is None:
        raise ConfigError("decide='latest' replaces the bottom quantile of the members' latest reports: rule= may "
                          f"hold only a ratio, got {rule}; use latest={{'cooldown': ...}} for a cap on replacements "
                          "or decide='complete' for threshold and age rules")
    if rule.ratio > 0.5:
        raise ConfigError(f"rule.ratio={rule.ratio} with decide='latest': the bottom and top quantiles would overlap; "
                          "give a ratio of at most 0.5")
    return float(rule.ratio)


def _max_donors_of(donor_rule: DonorRule) -> int | None:
    if donor_rule.kind == "random":
        raise ConfigError("donor_rule=DonorRule('random', ...) with decide='latest': donors are the members that lead "
                          "the judged rank; use DonorRule('best_k', k) or decide='complete'")
    return donor_rule.k if donor_rule.kind == "best_k" else None


def check_latest_only(decide: str, reference: int | None, explore: Any) -> None:
    """ConfigError for what only ``decide="latest"`` does: a reference agent, PB2's explore."""
    if reference is not None and (isinstance(reference, bool) or not isinstance(reference, int) or reference < 0):
        raise ConfigError(f"reference must be a global rank of the group (int >= 0) or None, got {reference!r}")
    if decide != "latest" and reference is not None:
        raise ConfigError("reference= needs decide='latest' (the complete protocol replaces by its rules alone)")
    if decide != "latest" and explore is not None and explore.pb2 is not None:
        raise ConfigError("Explore(pb2=...) needs decide='latest': PB2 models the members' reports on the "
                          "coordinator; use the perturbation explore (pb2=None) with decide='complete'")


def reference_in(reference: int | None, ranks: Any) -> frozenset[int]:
    """The reference agent's group rank, as a set (empty without one)."""
    if reference is None:
        return frozenset()
    if reference not in ranks:
        raise ConfigError(f"reference={reference} is not a rank of the training group {list(ranks)}")
    if len(ranks) < 3:
        raise ConfigError(f"reference={reference} leaves {len(ranks) - 1} agent(s) to select among: a population "
                          "with a reference agent needs at least 3 training ranks")
    return frozenset({list(ranks).index(reference)})


def check_lag(lag: int | None, decide: str, every: int) -> int | None:
    """The reproducible mode's declared lag, checked: an int in [1, every] with ``decide="latest"``."""
    if lag is None:
        return None
    if decide != "latest":
        raise ConfigError("lag= is the reproducible mode of decide='latest'; decide='complete' applies a decision "
                          "whenever its donors' weights arrive")
    if isinstance(lag, bool) or not isinstance(lag, int) or not 1 <= lag <= every:
        raise ConfigError(f"lag={lag!r}: give the iterations between a decision point and the call that applies its "
                          f"decision, an int in [1, every={every}] (so a round is applied before the next report)")
    return lag
