"""popmesh: distributed training of learning agents over torch.distributed, MPI and JAX.

Importing popmesh starts nothing and imports none of torch, mpi4py or jax (nor numpy): the public
names below load their modules on first use (PEP 562), so ``python -m popmesh launch`` and every
rank's bootstrap start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from popmesh.core.errors import (
    CollectiveMismatch,
    CommTimeout,
    ConfigError,
    EngineUnavailable,
    MessageError,
    NotInGroup,
    PeerClosed,
    PeerFailure,
    PopmeshError,
    WorldTooSmall,
)
from popmesh.core.version import __version__ as __version__

_LAZY = {
    "comm.collectives": (
        "all_reduce", "all_reduce_", "all_gather", "all_gather_ragged", "broadcast", "broadcast_", "gather",
        "reduce_scatter", "barrier", "all_gather_object", "broadcast_object", "gather_object",
    ),
    "comm.asynchronous": ("all_reduce_async", "all_reduce_async_", "AsyncHandle"),
    "comm.messages": ("send", "recv", "isend", "irecv", "SendHandle", "RecvHandle"),
    "topology.roles": ("Roles", "assign_roles"),
    "observe.timing": ("gather_timings", "report_timings", "report_imbalance"),
    "observe.board": ("Board",),
    "observe.progress": ("Progress",),
    "core.ops": ("ReduceOp",),
    "core.trace": ("span",),
    "comm.world": ("init", "finalize", "current_world", "World", "Group"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [name for names in _LAZY.values() for name in names] + [
    "PopmeshError", "ConfigError", "EngineUnavailable", "PeerFailure", "PeerClosed", "CommTimeout",
    "CollectiveMismatch", "MessageError", "NotInGroup", "WorldTooSmall",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'popmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
