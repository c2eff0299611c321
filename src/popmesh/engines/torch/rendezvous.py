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

A world that lost a rank forms again under a new generation (:func:`join_generation`, agreed through
:mod:`popmesh.engines.torch.generations`): there a member may die while the group connects, so the
group gets a short timeout of its own while it connects, and the next attempt is formed without it.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

from popmesh.core.errors import CommTimeout, ConfigError, PeerFailure, PopmeshError, WorldTooSmall
from popmesh.core.launch_env import TorchEnv
from popmesh.engines.torch.generations import (
    ATTEMPT,
    FORMED,
    Superseded,
    agree_roster,
    await_members,
    await_up,
    check_in,
    has_left,
    mark_formed,
    mark_up,
    next_attempt,
    nodes_of,
    poll_store,
    prefix,
    roster,
)
from popmesh.engines.torch.network import pin_interface, probe_ring, spans_hosts

__all__ = ["make_store", "join_world", "join_generation", "store_lost"]

_JOINED = "popmesh/joined/"
_CONNECT_GRACE_S = 0.5  # torch's own connect, once something listens, even at the deadline
_CONNECT_S = 0.5
"""The timeout of a re-formed generation's process group while it connects, at first. Every rank has
checked in by then, so gloo connects in 15-40 ms even with 4 ranks on a loaded 2-core box, unless a
member died after checking in; then the others give up after this, not after the whole timeout (gloo's
store waits after this, its wait for a peer that never connects after about 5x this), and form the next
attempt with the restarted process (which takes about 2 s to start). Doubled after each failed attempt,
so that a slow box is not mistaken for a lost rank twice; the timeout bounds it all."""
_GLOO_CONNECT_FACTOR = 5  # gloo waits up to about this many times its timeout for a peer that never connects


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


def join_generation(dist: Any, store: Any, env: TorchEnv, backend: str, attempt: int, timeout: float, *,
                    fresh: bool) -> tuple[int, tuple[int, ...]]:
    """Check in under ``attempt`` and form its process group once every member of its roster is there;
    the attempt that formed and its roster (this process's slot is ``env.rank``; its rank there is the
    slot's place in the roster). A newer attempt is joined instead where one starts (a rank died while this
    one formed, and was restarted, or was marked left), where the roster leaves this slot out (it joined
    after the roster was set), or where the group does not connect within :data:`_CONNECT_S` (a member died
    after checking in), until ``timeout``, CommTimeout after; the formed group keeps ``timeout`` for its
    collectives. An elastic world whose roster spans fewer than ``env.min_nodes`` nodes stops here
    (:func:`too_small`)."""
    deadline, connect, slot = time.monotonic() + timeout, _CONNECT_S, env.rank
    while True:
        members = agree_roster(store, attempt)
        if slot not in members:
            if has_left(store, slot):
                raise PopmeshError(f"slot {slot} was marked left for good (its launcher had no restart left), so this "
                                   "process cannot join the world")
            attempt = after_attempt(store, attempt, deadline, timeout)
            continue
        too_small(store, env, members)
        rank, size = members.index(slot), len(members)
        check_in(store, attempt, slot, fresh=fresh)
        try:
            await_members(store, attempt, members, deadline)
            left = (deadline - time.monotonic()) / _GLOO_CONNECT_FACTOR
            dist.init_process_group(backend, store=dist.PrefixStore(prefix(attempt), store), rank=rank,
                                    world_size=size, timeout=timedelta(seconds=max(min(connect, left), 0.1)))
            mark_up(store, attempt, slot)
            await_up(store, attempt, members, deadline)
            break
        except Superseded as e:
            _drop_group(dist)
            attempt = e.newer
        except PopmeshError:  # the timeout, naming the ranks that never came
            _drop_group(dist)
            raise
        except RuntimeError as e:  # the group did not connect: a member died while it formed
            _drop_group(dist)
            if time.monotonic() >= deadline:
                raise CommTimeout(f"the world did not re-form within {timeout:g} s: {e}", None) from e
            attempt, connect = next_attempt(store, attempt), 2 * connect
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))  # the collectives' timeout, not the connect's
    mark_formed(store, attempt)
    return attempt, members


def after_attempt(store: Any, attempt: int, deadline: float, timeout: float) -> int:
    """The attempt to join after ``attempt``, whose roster left this process out (it registered to join after
    the roster was set): once ``attempt`` formed or was given up, the one after it. Starting a newer attempt
    while ``attempt`` forms would split its members (those that saw every group up take it, the others move
    on)."""

    def settled() -> bool:
        return int(store.get(FORMED)) >= attempt or int(store.get(ATTEMPT)) > attempt

    poll_store(settled, deadline, lambda: CommTimeout(f"could not join the world within {timeout:g} s: generation "
                                                      f"{attempt}, which formed without this process, never settled",
                                                      None))
    return next_attempt(store, attempt)


def too_small(store: Any, env: TorchEnv, members: tuple[int, ...]) -> None:
    """:class:`WorldTooSmall` when an elastic world (``popmesh launch --nnodes MIN:MAX``) would form on fewer than MIN
    nodes; it names the ranks of the last formed world that were lost for good."""
    if env.min_nodes is None or not env.local_world_size:
        return
    nodes = nodes_of(members, env.local_world_size)
    if len(nodes) >= env.min_nodes:
        return
    formed = roster(store, int(store.get(FORMED)))
    gone = [rank for rank, slot in enumerate(formed) if slot not in members]
    raise WorldTooSmall(f"the world stops: after losing rank(s) {gone} for good it would go on with {len(nodes)} "
                      f"node(s), below --nnodes MIN={env.min_nodes}. Start a node to take their place (popmesh launch "
                      "--node-rank K with the same --nnodes), or give a lower MIN", gone)

def _drop_group(dist: Any) -> None:
    """Destroy the process group of an attempt that did not form (if its init got that far). A failed init
    had already counted the group for its name ("0", "1", ... in its rendezvous keys), and only destroying
    a world resets that count: reset here too, or this rank would wait under another name than the others
    in the next attempt."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.distributed_c10d._world.group_count = 0


def store_lost(env: TorchEnv, error: BaseException) -> PopmeshError:
    """The error of a re-form (or a join) whose rendezvous store no longer answers: what happened, and what to do."""
    where = f"{env.master_addr}:{env.master_port}"
    if env.joining:
        return PopmeshError(f"this process cannot join the world: its rendezvous store ({where}), served by node 0's "
                            f"popmesh launch, stopped answering ({error}). Has the run ended, or node 0's launcher "
                            "gone? Start a joining launcher while the world runs")
    if not env.agent_store:
        return PeerFailure(f"the world cannot re-form: its rendezvous store ({where}) was served by rank 0, which is "
                           f"gone ({error}). Nothing restarts lost ranks here, so nothing serves the store any more: "
                           "launch with popmesh launch --max-restarts N, whose launcher serves the store so that it "
                           "outlives every rank, rank 0 included", (0,))
    return PopmeshError(f"the world cannot re-form: its rendezvous store ({where}), served by the launcher (node 0's "
                        f"popmesh launch, or torchrun's agent), does not answer ({error}): is the launcher gone?")


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
