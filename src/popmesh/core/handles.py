"""The one family of handles for work in flight: what engines return, and what users hold.

An engine starts an operation and returns a :class:`Pending` (``done()`` polls, ``wait(timeout)``
blocks and raises CommTimeout or PeerFailure instead of hanging). The layers above wrap it in a
:class:`Handle`, which adds the call's default timeout and a ``finish`` step run once when the work
completes (divide an average, decode a message). ``all_reduce_async``, ``isend`` and ``irecv`` all
return a Handle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, overload

from popmesh.core.timeouts import resolve_timeout

__all__ = ["Pending", "Completed", "Handle"]

T = TypeVar("T")


class Pending(Protocol):
    """An operation an engine has in flight."""

    def done(self) -> bool: ...
    def wait(self, timeout: float) -> Any: ...


class Completed:
    """A Pending that finished before it was returned (a world of one, local or eager delivery)."""

    def __init__(self, value: Any = None) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> Any:
        return self._value


def _nothing(_: Any) -> None:
    return None


class Handle(Generic[T]):
    """Work in flight. ``done()`` polls without blocking; ``wait(timeout=None)`` blocks (default: the
    timeout of the call that started it) and returns the result, computed once. A ``wait`` that
    times out leaves the work in flight, so it may be waited for again."""

    _result: T  # set by the first wait() that finishes

    @overload
    def __init__(self: Handle[None], pending: Pending, timeout: float) -> None: ...
    @overload
    def __init__(self, pending: Pending, timeout: float, finish: Callable[[Any], T]) -> None: ...

    def __init__(self, pending: Pending, timeout: float, finish: Callable[[Any], Any] = _nothing) -> None:
        self._pending, self._timeout = pending, timeout
        self._finish: Callable[[Any], T] = finish
        self._waited = False

    def done(self) -> bool:
        return self._waited or bool(self._pending.done())

    def wait(self, timeout: float | None = None) -> T:
        """Block until finished (CommTimeout after ``timeout`` seconds) and return the result."""
        if not self._waited:
            raw = self._pending.wait(resolve_timeout(timeout, self._timeout, "timeout", "wait"))
            self._result = self._finish(raw)
            self._waited = True
        return self._result
