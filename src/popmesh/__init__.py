"""popmesh: distributed training of learning agents over torch.distributed, MPI and JAX.

Importing popmesh starts nothing and imports none of torch, mpi4py or jax.
"""

from .collectives import (
    all_gather,
    all_gather_object,
    all_gather_ragged,
    all_reduce,
    all_reduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    gather,
    gather_object,
    reduce_scatter,
)
from .asynchronous import AsyncHandle, all_reduce_async, all_reduce_async_
from .errors import (
    CollectiveMismatch,
    CommTimeout,
    ConfigError,
    EngineUnavailable,
    MessageError,
    NotInGroup,
    PeerFailure,
    PopmeshError,
)
from .ops import ReduceOp
from .world import Group, World, current_world, finalize, init

__version__ = "0.1.0"

__all__ = [
    "init",
    "finalize",
    "current_world",
    "World",
    "Group",
    "ReduceOp",
    "all_reduce",
    "all_reduce_",
    "all_reduce_async",
    "all_reduce_async_",
    "AsyncHandle",
    "all_gather",
    "all_gather_ragged",
    "broadcast",
    "broadcast_",
    "gather",
    "reduce_scatter",
    "barrier",
    "all_gather_object",
    "broadcast_object",
    "gather_object",
    "PopmeshError",
    "ConfigError",
    "EngineUnavailable",
    "PeerFailure",
    "CommTimeout",
    "CollectiveMismatch",
    "MessageError",
    "NotInGroup",
]
