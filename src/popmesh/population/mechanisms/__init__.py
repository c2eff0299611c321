"""The mechanisms that carry a decision out: they move weights between ranks.

The policy base and what a call returns or logs (:mod:`~popmesh.population.mechanisms.policy`,
:mod:`~popmesh.population.mechanisms.info`, :mod:`~popmesh.population.mechanisms.events`); the
synchronous policies over collectives (:mod:`~popmesh.population.mechanisms.average_all`,
:mod:`~popmesh.population.mechanisms.selective`); the asynchronous one over messages and a background
thread (:mod:`popmesh.population.mechanisms.asynchronous`); the one-sided one over MPI windows
(:mod:`~popmesh.population.mechanisms.one_sided`). Beside them, shared experience: each agent's latest
rollout to the others (:mod:`~popmesh.population.mechanisms.sharing`).

They decide with :mod:`popmesh.population.decisions` and apply with :mod:`popmesh.population.state`.
"""
