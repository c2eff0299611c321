"""The sending half of the MPI point-to-point transport: a frame's sends held until MPI completes
them, and frames waiting at the sender for room in their destination's window (see
:mod:`~popmesh.engines.mpi.flow` and :mod:`~popmesh.engines.mpi.p2p`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from popmesh.core.errors import CommTimeout, PeerFailure, PopmeshError
from popmesh.engines.base import poll_until

__all__ = ["MpiSend", "Transport", "WaitingSend", "unreceived"]


class Transport(Protocol):
    """What the sends need of the transport that holds them (:class:`~popmesh.engines.mpi.p2p.MpiP2P`)."""

    rank: int
    mpi: Any
    _lock: Any
    _gone: dict[int, PopmeshError]
    _window_nbytes: int
    _window_frames: int

    def _progressing(self, done: Callable[[], bool], every: int = 8) -> Callable[[], bool]: ...
    def _pump(self) -> None: ...
    def _isend(self, buffers: list[Any], dst: int, tag: int) -> MpiSend: ...


class MpiSend:
    """The Isends of one frame; keeps their buffers alive until all complete."""

    def __init__(self, owner: Transport, reqs: list[Any], keep: list[Any], dst: int, tag: int) -> None:
        self._owner, self._reqs, self._keep, self.dst, self.tag = owner, reqs, keep, dst, tag
        self._done = False

    def done(self) -> bool:
        if not self._done:
            with self._owner._lock:  # the heartbeat thread tests held sends too: never one request in two threads
                return self._test()
        return True

    def _test(self) -> bool:
        if not self._done:
            try:
                reqs = self._reqs
                self._done = bool(reqs[0].Test() if len(reqs) == 1 else self._owner.mpi.Request.Testall(reqs))
            except self._owner.mpi.Exception as e:
                raise PeerFailure(f"send to rank {self.dst} on tag {self.tag} failed in MPI: {e}", (self.dst,)) from e
            if self._done:
                self._keep = []
        return self._done

    def wait(self, timeout: float) -> None:
        gone = self._owner._gone
        if poll_until(self._owner._progressing(lambda: self.done() or self.dst in gone), timeout):
            if self.dst in gone and not self.done():
                raise PeerFailure(f"send to rank {self.dst} on tag {self.tag}: {gone[self.dst]}", (self.dst,))
            return
        raise unreceived(self.dst, self.tag, timeout)


def unreceived(dst: int, tag: int, timeout: float) -> CommTimeout:
    """The CommTimeout of a send posted to ``dst`` that its receiver has not received."""
    return CommTimeout(
        f"send to rank {dst} on tag {tag} did not complete within {timeout:g} s: that rank has not received it. "
        "The message stays in flight and is delivered when it does; leave the payload's arrays unchanged until "
        "then.", (dst,))


class WaitingSend:
    """A frame waiting at this rank for room in its destination's window (see flow); the next popmesh
    call that progresses posts it (:meth:`MpiP2P._pump`), and from then on it is the :class:`MpiSend`
    it became."""

    def __init__(self, owner: Transport, buffers: list[Any], dst: int, tag: int, nbytes: int) -> None:
        self._owner, self._buffers, self.dst, self.tag, self.nbytes = owner, buffers, dst, tag, nbytes
        self.op: MpiSend | None = None
        self.error: PopmeshError | None = None

    def start(self) -> None:
        """Post the frame now (the window has room); a failure is raised by :meth:`wait`."""
        try:
            self.op = self._owner._isend(self._buffers, self.dst, self.tag)
        except PopmeshError as e:
            self.error = e
        self._buffers = []

    def fail(self, error: PopmeshError) -> None:
        self.error, self._buffers = error, []

    def done(self) -> bool:
        if self.op is None and self.error is None:
            self._owner._pump()
        return self.error is not None or (self.op is not None and self.op.done())

    def wait(self, timeout: float) -> None:
        owner = self._owner
        gone = owner._gone
        if poll_until(owner._progressing(lambda: self.done() or self.dst in gone), timeout):
            if self.error is not None:
                raise self.error
            if self.op is not None and self.op.done():
                return
            raise PeerFailure(f"send to rank {self.dst} on tag {self.tag}: {gone[self.dst]}", (self.dst,))
        if self.op is not None:  # posted, not yet received
            raise unreceived(self.dst, self.tag, timeout)
        raise CommTimeout(
            f"send to rank {self.dst} on tag {self.tag} did not complete within {timeout:g} s: rank {self.dst} has "
            f"not received what rank {owner.rank} sent it before, and a sender keeps at most "
            f"{owner._window_nbytes} bytes or {owner._window_frames} messages in flight to each rank "
            "(POPMESH_P2P_BUFFER_BYTES shared among the senders). The message waits here, in order, and is sent "
            "when that rank receives; leave the payload's arrays unchanged until then.", (self.dst,))
