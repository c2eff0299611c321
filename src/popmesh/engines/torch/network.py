"""Where a torch world's transport listens, and a check that every rank can reach the next one.

gloo listens on the address of ``GLOO_SOCKET_IFNAME``'s interface, or else on the address the host's
own name resolves to; on a container or a fresh cloud VM that is a loopback address, and a world over
several hosts never forms (gloo's "connectFullMesh failed", after its full timeout when packets are
dropped). So before the process group forms:

* :func:`pin_interface` sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` (each unless the user
  set it) to the interface that routes to ``MASTER_ADDR`` (:mod:`popmesh.core.interfaces`); on one
  node (a loopback ``MASTER_ADDR``) to the loopback interface, so the world listens on no outside
  address;
* :func:`probe_ring`, on worlds that may span hosts, has every rank listen on the address its
  transport will use and publish it in the rendezvous store; each rank connects to the next rank's
  address. A rank that cannot within :data:`PROBE_S` seconds marks the store, and every rank raises
  :class:`ConfigError` naming the address that failed and the variable to set, instead of gloo's
  error minutes later.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import MutableMapping
from typing import Any

from popmesh.core.errors import CommTimeout, ConfigError
from popmesh.core.interfaces import (
    Choice,
    choose_interface,
    interface_address,
    is_loopback,
    list_interfaces,
    source_address,
)
from popmesh.core.launch_env import TorchEnv
from popmesh.engines.torch.generations import await_key

__all__ = ["PROBE_S", "IFNAME_VARS", "spans_hosts", "pin_interface", "probe_ring"]

PROBE_S = 10.0  # how long one rank tries to reach the next before the world gives up (no answer)
_REFUSED_S = 1.0  # a refused connection is final sooner: the listener was up before its address was published
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_KEY = "popmesh/net/"
_FAILED = _KEY + "failed"
_ALL_OK = _KEY + "ok"
_REACHED = _KEY + "reached"


def spans_hosts(env: TorchEnv) -> bool:
    """Whether the world may span several hosts: not when MASTER_ADDR is loopback, nor when this
    node runs every rank (LOCAL_WORLD_SIZE == WORLD_SIZE)."""
    if env.world_size < 2 or is_loopback(env.master_addr):
        return False
    return env.local_world_size != env.world_size


def pin_interface(env: TorchEnv, environ: MutableMapping[str, str] | None = None) -> Choice | None:
    """Set the interface variables the user left unset, for a world that meets at ``env.master_addr``.

    Returns the interface chosen (None where nothing was pinned: a world of one, a variable set by the
    user, one node whose MASTER_ADDR is not loopback, or no single interface to choose)."""
    environ = os.environ if environ is None else environ
    if env.world_size < 2 or all(environ.get(name) for name in IFNAME_VARS):
        return None
    interfaces = list_interfaces()
    if is_loopback(env.master_addr):
        loop = next((i for i in interfaces if i.loopback and i.up), None)
        choice = None if loop is None else Choice(loop.name, "127.0.0.1", "MASTER_ADDR is loopback: one node")
    elif not spans_hosts(env):
        return None  # one node with a named master: its own name resolves here, gloo's default works
    else:
        choice = choose_interface(env.master_addr, source_address(env.master_addr, env.master_port), interfaces)
    if choice is not None:
        for name in IFNAME_VARS:
            if not environ.get(name):
                environ[name] = choice.name
    return choice


def probe_ring(store: Any, env: TorchEnv, backend: str, choice: Choice | None, timeout: float) -> None:
    """Check that rank r reaches rank r+1 at the address its transport will listen on; ConfigError
    on every rank, naming the address and what to set, when one cannot within :data:`PROBE_S` s."""
    deadline = time.monotonic() + timeout
    try:
        address, how = _listen_address(backend, choice)
        with _Answerer(address, f"popmesh {env.rank} {os.urandom(8).hex()}") as answerer:
            store.set(_KEY + str(env.rank), f"{address} {answerer.port} {answerer.token} {socket.gethostname()} {how}")
            nxt = (env.rank + 1) % env.world_size
            entry = await_key(store, _KEY + str(nxt), deadline,
                              f"the world did not form: rank {nxt} never published its address in time")
            problem = _reach(env.rank, nxt, entry, backend)
            if problem is not None:
                raise ConfigError(problem)
            if store.add(_REACHED, 1) == env.world_size:
                store.set(_ALL_OK, "1")
            _await_verdict(store, deadline)
    except ConfigError as e:
        store.compare_set(_FAILED, "", str(e))  # the first failure is the one every rank reports
        raise ConfigError(bytes(store.get(_FAILED)).decode()) from e


class _Answerer:
    """A listener on the transport's address that answers every connection with ``token`` (so a prober
    knows it reached this rank, not another process at the same address and port), in a thread."""

    def __init__(self, address: str, token: str) -> None:
        self.token = token.replace(" ", "-")
        self._sock = _listener(address)
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="popmesh-net-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the 0.1 s tick, or the socket closed
                continue
            with conn:
                try:
                    conn.sendall(self.token.encode() + b"\n")
                except OSError:
                    pass

    def __enter__(self) -> _Answerer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


def _listen_address(backend: str, choice: Choice | None) -> tuple[str, str]:
    """The address this rank's transport will listen on, and how it was picked (for messages)."""
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    chosen = os.environ.get(variable)
    if chosen:
        name = chosen.split(",")[0].lstrip("=^")
        address = interface_address(name, list_interfaces())
        if address is None:
            raise ConfigError(f"{variable}={chosen!r} names no interface with an address on {socket.gethostname()}: "
                              f"set it to one of {_names()}")
        origin = "chosen by popmesh" if choice is not None and choice.name == name else "set by the user"
        return address, f"{variable}={name}, {origin}"
    host = socket.gethostname()
    try:
        address = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror:
        address = "127.0.0.1"
    return address, f"the address its host name {host} resolves to"


def _listener(address: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        return socket.create_server((address, 0), family=family, backlog=8)
    except OSError as e:
        raise ConfigError(f"cannot listen on {address}, the address this rank's transport would use on "
                          f"{socket.gethostname()} ({e.strerror}): set GLOO_SOCKET_IFNAME to one of {_names()}") from e


def _reach(rank: int, nxt: int, entry: str, backend: str) -> str | None:
    """None if rank ``nxt`` answers at its published address within PROBE_S, else why not."""
    address, port, token, host, how = entry.split(" ", 4)
    start = time.monotonic()
    deadline = start + PROBE_S
    why = "no answer"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, int(port)), timeout=max(deadline - time.monotonic(), 0.05)) as c:
                answer = c.makefile("rb").readline(256).decode(errors="replace").strip()
            if answer == token:
                return None
            why = f"another process answered there{': ' + answer if answer else ''}"
        except ConnectionRefusedError as e:
            why = e.strerror or "connection refused"
            if time.monotonic() - start >= _REFUSED_S:
                break
        except OSError as e:
            why = e.strerror or type(e).__name__
        time.sleep(0.1)
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    return (f"rank {rank} ({socket.gethostname()}) could not reach rank {nxt} ({host}) at {address}:{port} "
            f"({why}, {time.monotonic() - start:.1f} s); rank {nxt}'s transport would listen there ({how}). Every "
            f"rank must reach every other rank at that address: set {variable} on every host to the interface of "
            f"the network between them, or give MASTER_ADDR (--master-addr) an address of node 0 that every node "
            f"routes to over that network")


def _await_verdict(store: Any, deadline: float) -> None:
    pause = 0.005
    while True:
        if store.check([_FAILED]):
            raise ConfigError(bytes(store.get(_FAILED)).decode())
        if store.check([_ALL_OK]):
            return
        if time.monotonic() >= deadline:
            raise CommTimeout("the world did not form: not every rank checked that it reaches the next in time", None)
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def _names() -> str:
    return ", ".join(i.name for i in list_interfaces() if i.addresses) or "(none)"
