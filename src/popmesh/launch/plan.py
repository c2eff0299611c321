"""Pure launch planning: the environment each rank of a launched world receives.

Everything here is a function over plain values (no processes, no sockets), so the layout of
ranks, ports and thread shares can be tested directly. The runner turns a plan into processes.

Environment contract (torch and jax engines, one entry per local rank)::

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (node rank),
    MASTER_ADDR, MASTER_PORT, POPMESH_ENGINE, POPMESH_ERROR_FILE,
    OMP_NUM_THREADS, MKL_NUM_THREADS (each unless already set)
    torchrun's too (torch.distributed.elastic's LocalElasticAgent), so libraries that read them work:
    GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, TORCHELASTIC_RUN_ID,
    TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_USE_AGENT_STORE=False
    (rank 0 serves the store, not the launcher), TORCHELASTIC_ERROR_FILE (= POPMESH_ERROR_FILE),
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (unless already set)
    jax only: JAX_COORDINATOR_ADDRESS=<addr>:<port>, JAX_NUM_PROCESSES, JAX_PROCESS_ID
    torch only, local rank 0 of node 0: POPMESH_STORE_FD (a listening socket for TCPStore)

Under the mpi engine ranks come from mpiexec; the plan only sets ``POPMESH_ENGINE=mpi``,
``POPMESH_ERROR_FILE`` (with a ``{rank}`` placeholder) and the thread share.

On one node the torch and mpi engines' transports are pinned to the loopback interface
(:func:`loopback_env`) unless the user chose an interface, so that they listen on no external address.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from popmesh.core.errors import ConfigError
from popmesh.launch.hosts import Slots, ranks_on

__all__ = [
    "ENGINES",
    "STALE_PREFIXES",
    "STALE_NAMES",
    "LaunchSpec",
    "RankPlan",
    "validate",
    "thread_share",
    "cpu_count",
    "oversubscription_warning",
    "LOOPBACK_VARS",
    "loopback_interface",
    "loopback_env",
    "error_file_name",
    "base_env",
    "elastic_env",
    "plan_ranks",
    "plan_mpi_env",
    "shared_env",
    "is_module_name",
]

ENGINES = ("torch", "mpi", "jax")
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

# Variables of an enclosing world (an outer launcher, torchrun, mpiexec) that must not leak into
# the ranks we start: a child that saw an outer PMI_RANK could join the wrong world.
STALE_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "TORCHELASTIC_")
STALE_NAMES = (
    "POPMESH_ENGINE",
    "POPMESH_STORE_FD",
    "POPMESH_ERROR_FILE",
    "POPMESH_PARENT_PID",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# Per engine, the variables that choose the network interface its transport listens on: gloo's device;
# MPICH's netmods (UCX, which the mpich wheel uses, and libfabric's tcp, sockets and udp providers).
LOOPBACK_VARS: dict[str, tuple[str, ...]] = {
    "torch": ("GLOO_SOCKET_IFNAME",),
    "mpi": ("UCX_NET_DEVICES", "FI_TCP_IFACE", "FI_SOCKETS_IFACE", "FI_UDP_IFACE"),
}


@dataclass(frozen=True)
class LaunchSpec:
    """What to start on this node: ``nproc`` ranks of a world of ``nnodes * nproc``.

    ``run_id``, ``role`` and ``max_restarts`` are torchrun's (``TORCHELASTIC_RUN_ID``, ``ROLE_NAME``,
    ``TORCHELASTIC_MAX_RESTARTS``); ``max_restarts`` is the budget of restarts per rank (torch engine).
    ``hosts`` (mpi engine only) names the hosts one mpiexec starts the world on, with their ranks.
    ``preload`` names modules a fork server imports once before forking every local rank (torch and jax
    engines; :mod:`popmesh.launch.forkserver`).
    """

    nproc: int
    engine: str = "torch"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    run_id: str = "none"
    role: str = "default"
    max_restarts: int = 0
    hosts: Slots = ()
    preload: tuple[str, ...] = ()
    max_nodes: int | None = None  # --nnodes MIN:MAX with MIN < MAX: ``nnodes`` is MIN (torch engine)

    @property
    def world_size(self) -> int:
        """The ranks of the world as it first forms (MIN nodes' in an elastic world)."""
        return ranks_on(self.hosts) if self.hosts else self.nnodes * self.nproc

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX``: nodes past MIN join the running world, and a rank lost for good leaves it."""
        return self.max_nodes is not None

    @property
    def joins(self) -> bool:
        """This node starts after the world formed and joins it (its node rank is MIN or more)."""
        return self.elastic and self.node_rank >= self.nnodes

    @property
    def spans_nodes(self) -> bool:
        """More than one launcher may take part (``--nnodes`` above 1, or an elastic range)."""
        return (self.max_nodes or self.nnodes) > 1

    @property
    def serves_store_apart(self) -> bool:
        """True when the rendezvous store runs in a process of node 0's launcher, not in rank 0 (restarts,
        an elastic world)."""
        return self.engine == "torch" and (self.max_restarts > 0 or self.elastic)

    @property
    def hosts_store(self) -> bool:
        """True on the node whose launcher binds the rendezvous socket (node rank 0)."""
        return self.node_rank == 0


@dataclass(frozen=True)
class RankPlan:
    """One local rank: its global and local rank and the variables to add to its environment."""

    rank: int
    local_rank: int
    env: dict[str, str]


def validate(spec: LaunchSpec) -> None:
    """Raise :class:`ConfigError` saying what to change if ``spec`` cannot form a world."""
    if spec.engine not in ENGINES:
        raise ConfigError(f"unknown engine {spec.engine!r}; choose one of {', '.join(ENGINES)}")
    if spec.nproc < 1:
        raise ConfigError(f"need at least one process per node, got -n {spec.nproc}; pass -n 1 or more")
    if spec.nnodes < 1:
        raise ConfigError(f"need at least one node, got --nnodes {spec.nnodes}")
    if spec.elastic:
        _validate_range(spec)
    elif not 0 <= spec.node_rank < spec.nnodes:
        raise ConfigError(
            f"--node-rank {spec.node_rank} is outside 0..{spec.nnodes - 1}; "
            f"number the nodes 0 to --nnodes minus one"
        )
    if not 0 <= spec.master_port < 2**16:
        raise ConfigError(f"--master-port {spec.master_port} is not a TCP port; use 0 (pick a free one) to 65535")
    if not spec.master_addr:
        raise ConfigError("--master-addr is empty; give the host name or IP of node rank 0")
    if spec.spans_nodes and spec.master_port == 0:
        raise ConfigError(
            "with --nnodes > 1 every node must agree on the port: pass the same --master-port (or "
            "--rdzv-endpoint HOST:PORT) to all nodes"
        )
    if spec.nnodes > 1 and spec.engine == "mpi":
        raise ConfigError(
            "--engine mpi starts one mpiexec for the whole world, on every host at once: name the hosts "
            "with --hosts a:2,b:2 or --hostfile FILE instead of --nnodes"
        )
    if spec.hosts and spec.engine != "mpi":
        raise ConfigError(
            "--hosts/--hostfile name the hosts one mpiexec starts ranks on: add --engine mpi; for the torch "
            "engine start one popmesh launch per host with --nnodes, --node-rank and --master-addr"
        )
    _validate_elastic(spec)
    _validate_preload(spec)


def _validate_range(spec: LaunchSpec) -> None:
    """``--nnodes MIN:MAX``: a range the torch engine can grow and shrink within, and a node rank inside it."""
    assert spec.max_nodes is not None
    if not 1 <= spec.nnodes < spec.max_nodes:
        raise ConfigError(f"--nnodes {spec.nnodes}:{spec.max_nodes}: give 1 <= MIN < MAX (or one number for a "
                          "world of fixed size)")
    if spec.engine != "torch":
        raise ConfigError(
            f"--nnodes {spec.nnodes}:{spec.max_nodes} with --engine {spec.engine}: only the torch engine can take "
            "ranks into a running world or go on without one; MPI restarts the whole job from its last checkpoint "
            "(--max-restarts N, docs/survival.md), and jax.distributed has a fixed size")
    if not 0 <= spec.node_rank < spec.max_nodes:
        raise ConfigError(f"--node-rank {spec.node_rank} is outside 0..{spec.max_nodes - 1}: nodes 0 to MIN-1 "
                          f"({spec.nnodes - 1}) start the world, nodes MIN to MAX-1 join it later")


def _validate_preload(spec: LaunchSpec) -> None:
    """Module names the launcher's fork server can import, on an engine whose ranks the launcher starts."""
    if not spec.preload:
        return
    if spec.engine == "mpi":
        raise ConfigError(
            "--preload with --engine mpi: mpiexec starts the MPI ranks, so the launcher cannot fork them; "
            "leave --preload out"
        )
    bad = [name for name in spec.preload if not is_module_name(name)]
    if bad:
        raise ConfigError(f"--preload {','.join(spec.preload)}: {bad[0]!r} is not a module name; "
                          "give module names separated by commas, like torch,numpy")


def is_module_name(name: str) -> bool:
    """True for a dotted Python module name like ``pkg.train``."""
    return _MODULE_NAME.match(name) is not None


def shared_env(envs: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The variables every one of ``envs`` holds with the same value (what a fork server imports under)."""
    if not envs:
        return {}
    first, *rest = envs
    return {k: v for k, v in first.items() if all(other.get(k) == v for other in rest)}


def _validate_elastic(spec: LaunchSpec) -> None:
    """The torchrun settings: a restart budget the engine can use; names must not be empty."""
    if spec.max_restarts < 0:
        raise ConfigError(f"--max-restarts {spec.max_restarts}: give 0 (no restarts, the default) or more")
    if spec.max_restarts and spec.engine == "jax":
        raise ConfigError(
            f"--max-restarts {spec.max_restarts} with --engine jax: jax.distributed cannot take a restarted process "
            "back into a running job; pass --max-restarts 0 and restart the job from a checkpoint"
        )
    if not spec.role:
        raise ConfigError("--role is empty; give a name, or leave it out for torchrun's 'default'")
    if not spec.run_id:
        raise ConfigError("--rdzv-id is empty; give the job's id, or leave it out")


def thread_share(cpus: int, local_world_size: int) -> int:
    """Threads per rank so that the ranks of one node together use each core once (at least 1)."""
    return max(1, cpus // max(1, local_world_size))


def cpu_count() -> int:
    """Cores this process may run on (affinity mask when the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def oversubscription_warning(nproc: int, cpus: int) -> str | None:
    """The warning for ``nproc`` ranks on a node whose launcher may use ``cpus`` cores; None if they fit."""
    if nproc <= cpus:
        return None
    cores = f"{cpus} CPU core" + ("s" if cpus != 1 else "")
    return (
        f"popmesh launch: warning: {nproc} ranks on this node but only {cores} available to the launcher "
        f"(its CPU affinity), so the run will oversubscribe: ranks take turns on the cores, every collective "
        f"waits for the rank that is descheduled, and timeouts may fire. Start at most {cpus} ranks per node "
        f"(-n {cpus}), spread them over more nodes (--nnodes), or give the launcher more cores "
        f"(taskset, the job's CPU allocation)."
    )


def loopback_interface() -> str | None:
    """This machine's loopback interface ("lo" on Linux, "lo0" on macOS); None if it has none."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def loopback_env(parent: Mapping[str, str], spec: LaunchSpec, iface: str | None) -> dict[str, str]:
    """Variables that keep a one-node world's transport on ``iface`` (the loopback interface).

    A variable the user set (in ``parent``) is left alone; on several nodes, or without a loopback
    interface, nothing is pinned.
    """
    if spec.spans_nodes or spec.hosts or not iface:
        return {}
    return {name: iface for name in LOOPBACK_VARS.get(spec.engine, ()) if name not in parent}


def error_file_name(rank: int | str) -> str:
    """File name of one rank's error record inside the launcher's temporary directory."""
    return f"rank-{rank}.json"


def base_env(parent: Mapping[str, str], spec: LaunchSpec, cpus: int) -> dict[str, str]:
    """The parent environment minus an enclosing world's variables, plus thread shares."""
    env = {
        key: value
        for key, value in parent.items()
        if key not in STALE_NAMES and not key.startswith(STALE_PREFIXES)
    }
    share = str(thread_share(cpus, spec.nproc))
    for name in THREAD_VARS:
        env[name] = parent.get(name) or share
    if spec.engine != "mpi":  # torchrun's choice: a failed NCCL collective ends the rank, so the world stops
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env["POPMESH_ENGINE"] = spec.engine
    return env


def elastic_env(spec: LaunchSpec, rank: int, error_file: str, restart_count: int = 0) -> dict[str, str]:
    """torchrun's per-rank variables beyond RANK/WORLD_SIZE/LOCAL_*/MASTER_* (one role). With restarts the
    launcher serves the store (as torchrun's agent does), so that it outlives any rank."""
    return {
        "GROUP_WORLD_SIZE": str(spec.nnodes),
        "ROLE_NAME": spec.role,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "TORCHELASTIC_RUN_ID": spec.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": str(spec.serves_store_apart),
        "TORCHELASTIC_ERROR_FILE": error_file,
    }


def plan_ranks(spec: LaunchSpec, port: int, error_dir: str, *, store_fd: int | None = None) -> list[RankPlan]:
    """Per-rank variables for the torch and jax engines (to be added on top of :func:`base_env`).

    ``port`` is the resolved rendezvous port; ``store_fd`` the listening socket given to local
    rank 0 of node 0 (torch engine only).
    """
    validate(spec)
    if spec.engine == "mpi":
        raise ConfigError("plan_ranks plans locally spawned ranks; use plan_mpi_env for --engine mpi")
    plans = []
    for local_rank in range(spec.nproc):
        rank = spec.node_rank * spec.nproc + local_rank
        error_file = os.path.join(error_dir, error_file_name(rank))
        env = {
            "RANK": str(rank),
            # a joining node's ranks are numbered past the world's first size: WORLD_SIZE bounds them
            "WORLD_SIZE": str(spec.nproc * spec.max_nodes if spec.joins and spec.max_nodes else spec.world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(spec.nproc),
            "GROUP_RANK": str(spec.node_rank),
            "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(port),
            "POPMESH_ENGINE": spec.engine,
            "POPMESH_ERROR_FILE": error_file,
            **elastic_env(spec, rank, error_file),
        }
        if spec.engine == "jax":
            env["JAX_COORDINATOR_ADDRESS"] = f"{spec.master_addr}:{port}"
            env["JAX_NUM_PROCESSES"] = str(spec.world_size)
            env["JAX_PROCESS_ID"] = str(rank)
        if spec.engine == "torch" and store_fd is not None and rank == 0 and not spec.serves_store_apart:
            env["POPMESH_STORE_FD"] = str(store_fd)
        if spec.elastic:
            env["POPMESH_MIN_NODES"] = str(spec.nnodes)
            if spec.joins:
                env["POPMESH_JOIN"] = "1"
        plans.append(RankPlan(rank=rank, local_rank=local_rank, env=env))
    return plans


def plan_mpi_env(spec: LaunchSpec, error_dir: str, job_restarts: int = 0) -> dict[str, str]:
    """Variables added to mpiexec's environment (which it passes on to every rank). With ``--max-restarts``
    the whole job restarts (an MPI world cannot take one rank back), as torchrun restarts its whole
    worker group: every rank of the job's ``job_restarts``-th restart sees it in TORCHELASTIC_RESTART_COUNT."""
    validate(spec)
    restarts = ({"TORCHELASTIC_RESTART_COUNT": str(job_restarts), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts)}
                if spec.max_restarts else {})
    return {
        "POPMESH_ENGINE": "mpi",
        "POPMESH_ERROR_FILE": os.path.join(error_dir, error_file_name("{rank}")),
        **restarts,
    }
