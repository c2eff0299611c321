"""Ports for worlds a test starts by hand, held by the test so that no other process takes them.

Picking a free port, closing it and handing the number on races any process on the box that binds or
connects meanwhile (a second test worker, another world's ephemeral connections): the rank then waits
on a socket it did not make. A test holds the socket instead: a listening one passed to rank 0 as
``POPMESH_STORE_FD`` (as ``popmesh launch`` does), or a bound, never-listening one where the test wants
nobody to answer.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def store_listener(backlog: int = 64) -> Iterator[socket.socket]:
    """A listening loopback socket for rank 0's rendezvous store; pass ``store_env(sock)`` to rank 0."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(backlog)
        yield sock


@contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port bound by the test and never listened on: connections to it are refused for as
    long as the block runs, and nobody else can bind it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def store_env(sock: socket.socket) -> dict[str, str]:
    """Rank 0's extra environment: the held socket's descriptor (start the process with
    ``pass_fds=(sock.fileno(),)``)."""
    return {"POPMESH_STORE_FD": str(sock.fileno())}
