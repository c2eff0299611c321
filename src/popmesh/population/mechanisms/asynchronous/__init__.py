"""The asynchronous policy: training never waits for a peer.

:mod:`~popmesh.population.mechanisms.asynchronous.selective` (the policy a user calls),
:mod:`~popmesh.population.mechanisms.asynchronous.protocol` (messages, tags and the coordinator's
book, pure), :mod:`~popmesh.population.mechanisms.asynchronous.coordinator` (the coordinator's role),
:mod:`~popmesh.population.mechanisms.asynchronous.trainer` (a training rank's role),
:mod:`~popmesh.population.mechanisms.asynchronous.inbox` (streams kept and combined in donor order)
and :mod:`~popmesh.population.mechanisms.asynchronous.runtime` (the background thread).
"""
