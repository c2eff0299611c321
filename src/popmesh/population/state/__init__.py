"""An agent's state: its weights and optimizer as flat buffers, how a decision is applied to them,
whole-population checkpoints, and seeding a rank that rejoined.

:mod:`~popmesh.population.state.model_state` (snapshots, layouts, flat buffers),
:mod:`~popmesh.population.state.replace` (a decision applied to one agent: momentum, optimizer
policy, exploration), :mod:`~popmesh.population.state.checkpoint` (atomic, whole-population
checkpoints) and :mod:`~popmesh.population.state.rejoin` (a newcomer seeded from the best agents).

It may use the pure decisions (:mod:`popmesh.population.decisions`), never the mechanisms.
"""
