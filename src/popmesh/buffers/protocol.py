"""Messages of the replay-buffer service, the tags they travel on, and their (pickle-free) wire form.

Every message is one :mod:`popmesh.wire.encoding` DICT frame: a JSON header ``{"v": 1, "type": ..., "data":
{...}}`` stored as a uint8 array under :data:`HEADER_KEY`, plus, for DATA, the batch's arrays under
their own keys. So a trainer, a manager and the coordinator may run on any engine and never unpickle
anything a peer sent.

Channels (all in popmesh's reserved tag range, :data:`popmesh.comm.messages.BUFFERS_TAGS`):

==================  ===============================================================================
``REQUEST_TAG``      manager inbox: DATA, GET_METADATA, EXIT (agents), BASELINE_SYNC and EXIT_ACK
                     (coordinator)
``SCORE_TAG``        trainer inbox: SCORE replies to DATA, a manager's ERROR replies to anything but
                     GET_METADATA
``METADATA_TAG``     trainer inbox: METADATA replies and ERROR replies to GET_METADATA (apart, so a
                     pending score never gets in the way)
``COORDINATOR_TAG``  coordinator inbox: MODE_REPORT, BASELINE_REPORT, EXIT (managers),
                     GET_POPULATION_STATS (trainers)
``STATS_TAG``        trainer inbox: POPULATION_STATS and ERROR replies from the coordinator
==================  ===============================================================================

Shutdown leaves nothing in flight: an agent collects its last score before its EXIT; a manager, once
all its agents left, sends EXIT to the coordinator and keeps reading until the coordinator's
EXIT_ACK, so every BASELINE_SYNC sent before it has been received (same channel, in order).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.comm.messages import internal_tag
from popmesh.core.errors import MessageError, PopmeshError

__all__ = [
    "MessageType", "Message", "ProtocolError", "ServiceError", "HEADER_KEY", "PROTOCOL_VERSION", "REQUEST_TAG",
    "SCORE_TAG", "METADATA_TAG", "COORDINATOR_TAG", "STATS_TAG", "to_payload", "from_payload", "check_message",
    "batch_size",
]

PROTOCOL_VERSION = 1
HEADER_KEY = "__popmesh_buffers__"
REQUEST_TAG = internal_tag(0)
SCORE_TAG = internal_tag(1)
METADATA_TAG = internal_tag(2)
COORDINATOR_TAG = internal_tag(3)
STATS_TAG = internal_tag(4)


class MessageType(enum.Enum):
    """What a service message asks or answers (torchgfn's types plus the replies, named)."""

    DATA = "DATA"
    GET_METADATA = "GET_METADATA"
    EXIT = "EXIT"
    MODE_REPORT = "MODE_REPORT"
    GET_POPULATION_STATS = "GET_POPULATION_STATS"
    BASELINE_REPORT = "BASELINE_REPORT"
    BASELINE_SYNC = "BASELINE_SYNC"
    EXIT_ACK = "EXIT_ACK"
    SCORE = "SCORE"
    METADATA = "METADATA"
    POPULATION_STATS = "POPULATION_STATS"
    ERROR = "ERROR"


class ProtocolError(MessageError):
    """A frame that decoded fine but is not a well-formed service message."""


class ServiceError(PopmeshError):
    """A manager or the coordinator answered a request with ERROR: ``rank`` refused ``request`` (a
    MessageType value); the message says why. The service goes on; so may the caller."""

    def __init__(self, message: str, rank: int, request: str) -> None:
        super().__init__(message)
        self.rank, self.request = rank, request

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.rank, self.request)


@dataclass(frozen=True)
class Message:
    """A service message: its type, JSON-able ``data``, and for DATA the ``batch`` of arrays."""

    type: MessageType
    data: dict[str, Any] = field(default_factory=dict)
    batch: dict[str, Any] | None = None


def batch_size(batch: Any) -> int:
    """Rows in ``batch`` (a dict of str to arrays sharing their leading dimension); ProtocolError if malformed."""
    if not isinstance(batch, Mapping) or not batch:
        raise ProtocolError("a batch is a non-empty dict of str to arrays sharing their leading dimension")
    sizes = {}
    for key, value in batch.items():
        shape = getattr(value, "shape", None)
        if type(key) is not str or key.startswith("__") or shape is None or len(shape) == 0:
            raise ProtocolError(f"batch entry {key!r}: keys are strings not starting with '__' and values are "
                                "arrays or tensors with a leading (row) dimension")
        sizes[key] = int(shape[0])
    if len(set(sizes.values())) != 1:
        raise ProtocolError(f"batch entries have different row counts: {sizes}")
    return next(iter(sizes.values()))


def _header(message: Message) -> bytes:
    header = {"v": PROTOCOL_VERSION, "type": message.type.value, "data": message.data}
    try:
        return json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"{message.type.value} data must be JSON-able (dicts with str keys, lists, numbers, "
                            f"strings; numpy scalars: call .item()): {e}") from e


def check_message(message: Message) -> None:
    """ProtocolError unless :func:`to_payload` can carry ``message`` (checked without building it)."""
    _header(message)
    if message.batch is not None:
        batch_size(message.batch)


def to_payload(message: Message) -> dict[str, Any]:
    """The dict of arrays that carries ``message`` (send it with :func:`popmesh.comm.messages.send`)."""
    payload: dict[str, Any] = {HEADER_KEY: np.frombuffer(_header(message), dtype=np.uint8)}
    if message.batch is not None:
        batch_size(message.batch)
        payload.update(message.batch)
    return payload


def from_payload(payload: Any) -> Message:
    """Parse a received payload; ProtocolError when it is not a service message of this version."""
    raw = payload.get(HEADER_KEY) if isinstance(payload, dict) else None
    if raw is None or getattr(raw, "dtype", None) != np.uint8 or getattr(raw, "ndim", None) != 1:
        raise ProtocolError(f"not a replay-buffer service message (no {HEADER_KEY!r} header): got a "
                            f"{type(payload).__name__}")
    try:
        header = json.loads(np.asarray(raw).tobytes().decode("utf-8"))
        version, kind, data = header["v"], MessageType(header["type"]), header["data"]
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed service message header: {e}") from e
    if version != PROTOCOL_VERSION or not isinstance(data, dict):
        raise ProtocolError(f"service protocol version {version} (this rank speaks {PROTOCOL_VERSION}) or "
                            "non-dict data: run the same popmesh version on every rank")
    batch = {k: v for k, v in payload.items() if k != HEADER_KEY}
    if batch:
        batch_size(batch)
    return Message(kind, data, batch or None)
