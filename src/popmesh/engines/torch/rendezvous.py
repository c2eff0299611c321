"""Forming a torch.distributed world within the configured timeout: the TCPStore, then the process group.

A world that cannot form fails within about ``timeout`` (``POPMESH_TIMEOUT``) on every rank that
started, with a CommTimeout that names the ranks that never joined where it can. torch's own
timeouts do not give that:

* a non-master rank's TCPStore client retries: when its first connection attempt ends before the
  deadline (its back-off may overshoot), it sleeps a random back-off and starts a second attempt of
  the full timeout, so a world whose rank 0 never started failed after up to about 3x the timeout;
* a store socket that accepts connections but never answers (under ``popmesh launch`` rank 0's
  socket is bound by the launcher, so it accepts even when rank 0 died) left the client waiting with
  no timeout at all.

So a non-master rank first waits, in Python and with popmesh's deadline, until something accepts
connections at MASTER_ADDR:MASTER_PORT, and only then lets torch connect, in a daemon thread that it
stops waiting for at the deadline. (A thread left in torch's connect could abort the process if it
returned during interpreter shutdown; after the wait it is left behind only by a socket that never
answers.) The process group's rendezvous (gloo's store waits) keeps to the timeout already; its
failure names only store keys, so each rank first leaves a mark in the store, and the error names
the ranks whose mark is missing (rank 0 always can; another rank only while rank 0, which holds the
store and began waiting first, is still there).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

from popmesh.core.errors import CommTimeout, ConfigError, PopmeshError
from popmesh.core.launch_env import TorchEnv
from popmesh.engines.torch.network import pin_interface, probe_ring, spans_hosts

__all__ = ["make_store", "join_world"]

_JOINED = "popmesh/joined/"
_CONNECT_GRACE_S = 0.5  # torch's own connect, once something listens, even at the deadline


def make_store(dist: Any, env: TorchEnv, timeout: float) -> Any:
    """The rendezvous store: rank 0 serves it (on the socket ``popmesh launch`` bound, if any), the
    other ranks connect to it, giving up after about ``timeout`` seconds (CommTimeout). Under
    torchrun, whose agent already serves a store there, every rank connects."""
    if env.rank == 0 and not env.agent_store:
        return _tcp_store(dist, env, timeout)
    deadline = time.monotonic() + timeout
    _await_listener(env, timeout, deadline)
    outcome: dict[str, Any] = {}

    def connect() -> None:
        try:
            outcome["store"] = _tcp_store(dist, env, timeout)
        except BaseException as e:  # handed to the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=connect, name="popmesh-store-connect", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), _CONNECT_GRACE_S))
    if "error" in outcome:
        raise outcome["error"]
    if "store" not in outcome:
        raise CommTimeout(_unreachable(env, timeout, "it accepts connections but does not answer"), (0,))
    return outcome["store"]


def _await_listener(env: TorchEnv, timeout: float, deadline: float) -> None:
    """Return once something accepts connections at MASTER_ADDR:MASTER_PORT; CommTimeout at ``deadline``."""
    pause = 0.01
    while True:
        try:
            socket.create_connection((env.master_addr, env.master_port),
                                     timeout=max(deadline - time.monotonic(), 0.01)).close()
            return
        except socket.gaierror as e:
            raise ConfigError(f"MASTER_ADDR={env.master_addr!r} does not resolve ({e}): set it to rank 0's host "
                              "name or address") from e
        except OSError as e:
            if time.monotonic() + pause >= deadline:
                raise CommTimeout(_unreachable(env, timeout, str(e) or type(e).__name__), (0,)) from e
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


def join_world(dist: Any, store: Any, env: TorchEnv, backend: str, timeout: float) -> None:
    """``init_process_group`` over ``store``; CommTimeout naming the ranks that never joined if the
    world does not form within ``timeout``. A world that may span hosts first checks that each rank
    reaches the next at the address its transport will use (:func:`~popmesh.engines.torch.network.probe_ring`):
    the interface chosen by :func:`~popmesh.engines.torch.network.pin_interface`, which runs first."""
    choice = pin_interface(env)
    try:
        store.set(_JOINED + str(env.rank), b"1")
        if spans_hosts(env):
            probe_ring(store, env, backend, choice, timeout)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout))
    except ConfigError:  # the probe's verdict: it says what to set
        raise
    except (RuntimeError, CommTimeout) as e:  # torch's DistStoreError, DistNetworkError, gloo's errors; the probe's
        missing = _not_joined(store, env.world_size)
        if missing == ():
            if isinstance(e, CommTimeout):
                raise
            raise PopmeshError(f"rank {env.rank} could not form the torch.distributed world of {env.world_size} "
                               f"ranks ({backend}) although every rank joined the rendezvous: {e}") from e
        who = (f"rank(s) {list(missing)} never joined" if missing else
               "rank 0, which holds the rendezvous store, is gone too (its error names the ranks that never joined)")
        raise CommTimeout(
            f"the world of {env.world_size} ranks did not form within {timeout:g} s: {who}. Start every rank "
            f"(popmesh launch -n {env.world_size} starts them all) with the same MASTER_ADDR:MASTER_PORT "
            f"({env.master_addr}:{env.master_port}), or raise POPMESH_TIMEOUT", missing) from e


def _not_joined(store: Any, size: int) -> tuple[int, ...] | None:
    """The ranks without a mark in the store (None if the store cannot tell: its host may be gone)."""
    try:
        return tuple(r for r in range(size) if not store.check([_JOINED + str(r)]))
    except Exception:  # any store failure means "cannot tell"
        return None


def _tcp_store(dist: Any, env: TorchEnv, timeout: float) -> Any:
    """torch's TCPStore. ``multi_tenant`` lets a later env:// init in the same process (a user script
    calling init_process_group itself) reuse rank 0's server instead of failing to bind."""
    is_master = env.rank == 0 and not env.agent_store  # under torchrun its agent serves the store
    kwargs: dict[str, Any] = {}
    if is_master and env.store_fd is not None:
        kwargs["master_listen_fd"] = env.store_fd
    try:
        return dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master,
            timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True, **kwargs,
        )
    except (RuntimeError, OSError) as e:
        raise CommTimeout(_unreachable(env, timeout, str(e)), None if is_master else (0,)) from e


def _unreachable(env: TorchEnv, timeout: float, why: str) -> str:
    return (f"rank {env.rank} could not reach the rendezvous store at {env.master_addr}:{env.master_port} within "
            f"{timeout:g} s ({why}). Is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?")
