"""The pure decisions of a population: pure functions over plain values, no process, no model.

Who is replaced and who donates (:mod:`~popmesh.population.decisions.selection`), with what weights
(:mod:`~popmesh.population.decisions.combine`), the whole :class:`~popmesh.population.Decision`
(:mod:`~popmesh.population.decisions.decision`), decisions against each member's latest report that
never wait for the slowest (:mod:`~popmesh.population.decisions.latest`), hyper-parameter exploration
and its typed declarations (:mod:`~popmesh.population.decisions.explore`), PB2's model-based
exploration (:mod:`~popmesh.population.decisions.pb2`) and the options every
selective policy checks once (:mod:`~popmesh.population.decisions.options`).

Nothing here imports the agent state (:mod:`popmesh.population.state`) or the mechanisms
(:mod:`popmesh.population.mechanisms`); ``tests/unit/test_layering.py`` holds it to that.
"""

from popmesh.population.decisions.pb2 import PB2, Observation, pb2_explore

__all__ = ["PB2", "Observation", "pb2_explore"]
