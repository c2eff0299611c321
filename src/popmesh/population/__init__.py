"""Population policies: replace weak agents by combinations of better ones.

Three sub-packages, one layer each (see docs/architecture.md):

* :mod:`popmesh.population.decisions`, pure functions over plain values: who is replaced
  (:mod:`~popmesh.population.decisions.selection`), with what weights
  (:mod:`~popmesh.population.decisions.combine`), the complete :class:`Decision`, decisions against
  each member's latest report (:func:`judge`) and hyper-parameter exploration (:func:`explore`,
  with typed declarations). Higher metric is better; non-finite metrics count as worst.
* :mod:`popmesh.population.state`: an agent's weights as flat buffers, a decision applied to them,
  whole-population checkpoints, seeding a rejoined rank.
* :mod:`popmesh.population.mechanisms`, the policies that move the weights, all called as
  ``policy(iteration, model, optimizer, local_metric, group=None)`` and returning
  ``(model, optimizer, PolicyInfo)``: :class:`AverageAll` and :class:`SelectiveAveraging`
  (synchronous, collectives), :class:`AsyncSelectiveAveraging` (messages and a background thread;
  training never waits) and :class:`OneSidedAveraging` (MPI one-sided windows). See
  ``docs/population.md``.
"""

from popmesh.population.decisions.combine import (
    DEFAULT_OPTIMIZER_POLICY,
    OptimizerPolicy,
    Strategy,
    apply_momentum,
    averaging_weights,
    combine,
    optimizer_action,
    rank_weights,
)
from popmesh.population.decisions.decision import Decision, decide
from popmesh.population.decisions.explore import (
    Categorical,
    Continuous,
    Declaration,
    Integer,
    explore,
    sample_hparams,
)
from popmesh.population.decisions.latest import LatestRules, LatestState, Report, Verdict, init_latest, judge
from popmesh.population.decisions.options import Explore, SelectiveOptions
from popmesh.population.decisions.pb2 import PB2, Observation, pb2_explore
from popmesh.population.decisions.selection import (
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
from popmesh.population.mechanisms.asynchronous.selective import AsyncSelectiveAveraging
from popmesh.population.mechanisms.average_all import AverageAll
from popmesh.population.mechanisms.events import EventLog
from popmesh.population.mechanisms.info import PolicyInfo
from popmesh.population.mechanisms.one_sided import OneSidedAveraging
from popmesh.population.mechanisms.policy import PopulationPolicy
from popmesh.population.mechanisms.selective import SelectiveAveraging
from popmesh.population.mechanisms.sharing import SampleSharing

__all__ = [
    "AsyncSelectiveAveraging",
    "AverageAll",
    "EventLog",
    "Explore",
    "OneSidedAveraging",
    "PopulationPolicy",
    "PolicyInfo",
    "SampleSharing",
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
    "Categorical",
    "Continuous",
    "Declaration",
    "Integer",
    "sample_hparams",
    "PB2",
    "Observation",
    "pb2_explore",
    "LatestRules",
    "LatestState",
    "Report",
    "Verdict",
    "init_latest",
    "judge",
]
