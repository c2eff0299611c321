"""The remote replay-buffer service: managers score and keep agents' batches, a coordinator aggregates.

Roles come from :class:`~popmesh.topology.roles.Roles`: training ranks use a
:class:`ReplayBufferClient`, buffer ranks run a :class:`ReplayBufferManager`, the coordinator rank
runs a :class:`Coordinator`. Messages are pickle-free DICT frames on popmesh's reserved tags
(:mod:`popmesh.buffers.protocol`); see ``docs/buffers.md``.
"""

from popmesh.buffers.baselines import BASELINE_STRATEGIES
from popmesh.buffers.client import MODES, ReplayBufferClient
from popmesh.buffers.coordinator import Coordinator
from popmesh.buffers.manager import ManagerStats, ReplayBufferManager, novelty_score
from popmesh.buffers.protocol import Message, MessageType, ProtocolError, ServiceError
from popmesh.buffers.store import LocalStore

__all__ = [
    "BASELINE_STRATEGIES",
    "MODES",
    "Coordinator",
    "LocalStore",
    "ManagerStats",
    "Message",
    "MessageType",
    "ProtocolError",
    "ReplayBufferClient",
    "ReplayBufferManager",
    "ServiceError",
    "novelty_score",
]
