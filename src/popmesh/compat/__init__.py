"""Compatibility facades: the five seed APIs under their own names, over popmesh's core.

Each facade module has the original's public names, parameters (names, order, defaults) and
documented behaviour, and holds no logic beyond translating arguments to popmesh, except where
the original's own results depend on it (spawn_policy's one-sided policies decide per rank as
torchgfn does; OmniSafe's float32 reduction of mixed dtypes). Where the original has a bug, the
facade behaves correctly and its docstring says what differs; see ``docs/migrating.md`` for the
name-by-name mapping.

* ``popmesh.compat.evorl``: ``evorl.distributed`` (EvoRL, the ``DP_AXIS_NAME`` generation); ``[jax]``
* ``popmesh.compat.xlstm_jax``: ``xlstm_jax.distributed.data_parallel`` (FSDP in shard_map); ``[jax]``
* ``popmesh.compat.omnisafe``: ``omnisafe.utils.distributed``; ``[torch]``
* ``popmesh.compat.gfn``: ``gfn.utils.distributed`` (torchgfn); ``[torch]`` / ``[mpi]``
* ``popmesh.compat.spawn_policy``: ``spawn_policy`` (torchgfn's multinode example); ``[torch]`` / ``[mpi]``

Importing ``popmesh.compat`` imports none of them; import the facade module itself.
"""

__all__: list[str] = []
