"""Population policies: replace weak agents by combinations of better ones.

The pure decision core: who is replaced (:mod:`.selection`), with what weights (:mod:`.combine`),
the complete :class:`Decision` (:mod:`.decision`) and hyper-parameter exploration (:mod:`.explore`).
Higher metric is better; non-finite metrics count as worst.

The mechanisms, all called as ``policy(iteration, model, optimizer, local_metric, group=None)``
and returning ``(model, optimizer, PolicyInfo)``: :class:`AverageAll` and
:class:`SelectiveAveraging` (synchronous, collectives), :class:`AsyncSelectiveAveraging`
(messages and a background thread; training never waits) and :class:`OneSidedAveraging` (MPI
one-sided windows). See ``docs/population.md``.
"""

from popmesh.population.async_selective import AsyncSelectiveAveraging
from popmesh.population.average_all import AverageAll
from popmesh.population.combine import (
    DEFAULT_OPTIMIZER_POLICY,
    OptimizerPolicy,
    Strategy,
    apply_momentum,
    averaging_weights,
    combine,
    optimizer_action,
    rank_weights,
)
from popmesh.population.decision import Decision, decide
from popmesh.population.events import EventLog
from popmesh.population.explore import explore
from popmesh.population.info import PolicyInfo
from popmesh.population.one_sided import OneSidedAveraging
from popmesh.population.options import Explore, SelectiveOptions
from popmesh.population.policy import PopulationPolicy
from popmesh.population.selection import (
    AgeState,
    DonorRule,
    ReplacementRule,
    SelectionState,
    below_threshold,
    combine_rules,
    donors_all_others,
    donors_best_k,
    donors_random,
    due_by_age,
    init_ages,
    init_state,
    order_worst_first,
    select_donors,
    step_ages,
    update_state,
    worst_by_ratio,
)
from popmesh.population.selective import SelectiveAveraging

__all__ = [
    "AsyncSelectiveAveraging",
    "AverageAll",
    "EventLog",
    "Explore",
    "OneSidedAveraging",
    "PopulationPolicy",
    "PolicyInfo",
    "SelectiveAveraging",
    "SelectiveOptions",
    "AgeState",
    "DEFAULT_OPTIMIZER_POLICY",
    "Decision",
    "DonorRule",
    "OptimizerPolicy",
    "ReplacementRule",
    "SelectionState",
    "Strategy",
    "apply_momentum",
    "averaging_weights",
    "below_threshold",
    "combine",
    "combine_rules",
    "decide",
    "donors_all_others",
    "donors_best_k",
    "donors_random",
    "due_by_age",
    "explore",
    "init_ages",
    "init_state",
    "optimizer_action",
    "order_worst_first",
    "rank_weights",
    "select_donors",
    "step_ages",
    "update_state",
    "worst_by_ratio",
]
