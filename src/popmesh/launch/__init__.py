"""Start, watch and tear down a world of ranks: ``launch()``, ``fork()``, ``popmesh info``.

Importing this package imports no engine (torch, mpi4py and jax are left alone); it needs only
the standard library. See docs/launcher.md for the environment each rank receives.
"""

from popmesh.launch.api import launch
from popmesh.launch.fork import fork, in_launched_world
from popmesh.launch.info import collect_info
from popmesh.launch.plan import ENGINES, LaunchSpec, RankPlan, plan_ranks
from popmesh.launch.result import LaunchFailed, LaunchResult, RankFailure

__all__ = [
    "launch",
    "fork",
    "in_launched_world",
    "collect_info",
    "ENGINES",
    "LaunchSpec",
    "RankPlan",
    "plan_ranks",
    "LaunchFailed",
    "LaunchResult",
    "RankFailure",
]
