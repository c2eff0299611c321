"""Per-rank error records: how a failing rank tells the launcher its traceback.

The bootstrap writes one JSON file per failed rank (path in ``POPMESH_ERROR_FILE``, where
``{rank}`` is replaced by the rank) and the launcher reads them back to name the root cause.
Reading a pipe tail alone is unreliable: a traceback can be interleaved with other output or cut
off when the process group is killed; the file is written before the rank exits.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from popmesh.core.errors import PeerFailure

__all__ = [
    "ErrorRecord",
    "error_file_path",
    "format_exception",
    "make_record",
    "write_error_file",
    "read_error_file",
    "rank_from_env",
]

_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


@dataclass(frozen=True)
class ErrorRecord:
    """What one rank reported about the exception that ended it. ``peers``: the ranks a
    :class:`~popmesh.core.errors.PeerFailure` in the exception's chain named exactly; this rank failed
    because of them, so it is not the root cause when one of them failed too."""

    rank: int
    type: str
    message: str
    traceback: str
    time: float
    pid: int
    host: str
    peers: tuple[int, ...] = ()


def rank_from_env(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank from the launcher's or the MPI library's variables (0 if none)."""
    variables = os.environ if env is None else env
    for name in _RANK_VARS:
        value = variables.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def error_file_path(template: str | None = None, rank: int | None = None) -> str | None:
    """The error file of this rank: ``template`` (default ``$POPMESH_ERROR_FILE``) with ``{rank}`` filled."""
    template = os.environ.get("POPMESH_ERROR_FILE") if template is None else template
    if not template:
        return None
    return template.replace("{rank}", str(rank_from_env() if rank is None else rank))


def _trimmed(tb: TracebackType | None, skip_files: tuple[str, ...]) -> TracebackType | None:
    """Drop the leading frames whose files are in ``skip_files`` (the bootstrap and runpy)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in skip_files:
        tb = tb.tb_next
    return tb


def format_exception(exc: BaseException, skip_files: tuple[str, ...] = ()) -> str:
    """The traceback text Python would print, without leading frames from ``skip_files`` (full paths)."""
    return "".join(traceback.format_exception(type(exc), exc, _trimmed(exc.__traceback__, skip_files)))


def blamed_peers(exc: BaseException) -> tuple[int, ...]:
    """The ranks the first exact :class:`PeerFailure` in ``exc``'s chain (its causes and contexts) names."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PeerFailure) and current.exact:
            return current.ranks
        current = current.__cause__ or current.__context__
    return ()


def make_record(exc: BaseException, skip_files: tuple[str, ...] = ()) -> ErrorRecord:
    """An :class:`ErrorRecord` of ``exc`` raised in this process."""
    return ErrorRecord(
        rank=rank_from_env(),
        type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        message=str(exc),
        traceback=format_exception(exc, skip_files),
        time=time.time(),
        pid=os.getpid(),
        host=socket.gethostname(),
        peers=blamed_peers(exc),
    )


def write_error_file(record: ErrorRecord, path: str) -> None:
    """Write ``record`` as JSON to ``path`` atomically (temp file, then rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record.__dict__, f)
    os.replace(tmp, path)


def read_error_file(path: str) -> ErrorRecord | None:
    """The record at ``path``, or None if the rank wrote none (or it is unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        fields = {key: data[key] for key in ErrorRecord.__dataclass_fields__ if key != "peers"}
        return ErrorRecord(**fields, peers=tuple(int(r) for r in data.get("peers", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None
