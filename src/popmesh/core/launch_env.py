"""Reading the distributed environment: which engine, which rank, which rendezvous. Pure functions."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from popmesh.core.errors import ConfigError
from popmesh.core.slurm import read_slurm
from popmesh.core.timeouts import check_timeout

__all__ = [
    "ENGINES",
    "DEFAULT_TIMEOUT_S",
    "TorchEnv",
    "detect_engine",
    "read_torch_env",
    "read_timeout",
    "read_check",
    "read_number",
    "launcher_world_size",
    "first_env",
]

ENGINES = ("local", "torch", "mpi")
DEFAULT_TIMEOUT_S = 300.0
_MPI_MARKERS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def first_env(environ: Mapping[str, str], *names: str, default: str | None = None) -> str | None:
    """The first non-empty variable among ``names``."""
    for name in names:
        value = environ.get(name)
        if value:
            return value
    return default


def detect_engine(environ: Mapping[str, str] | None = None) -> str:
    """``POPMESH_ENGINE`` if set; under mpiexec → mpi; under torchrun/`popmesh launch` → torch; else local.

    ConfigError when only one of RANK and WORLD_SIZE is set (and no engine is named)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("POPMESH_ENGINE")
    if explicit:
        if explicit not in ENGINES + ("jax",):
            raise ConfigError(f"POPMESH_ENGINE={explicit!r} is not an engine: use one of {', '.join(ENGINES)}")
        return "local" if explicit == "jax" else explicit
    if any(environ.get(name) for name in _MPI_MARKERS):
        return "mpi"
    rank, size = environ.get("RANK"), environ.get("WORLD_SIZE")
    if rank and size:
        return "torch"
    if not rank and not size and read_slurm(environ) is not None:
        return "torch"  # a task of `srun python script.py`: torch's rendezvous on the step's first node
    if rank or size:  # half a launch: running a world of one here would hide it
        have, lack = ("RANK", "WORLD_SIZE") if rank else ("WORLD_SIZE", "RANK")
        raise ConfigError(f"{have} is set but {lack} is not: set {lack} as well (popmesh launch and torchrun set "
                          f"both), or unset {have} to run a world of one")
    return "local"


@dataclass(frozen=True)
class TorchEnv:
    """Rendezvous facts for a torch.distributed world, validated."""

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    master_addr: str
    master_port: int
    store_fd: int | None
    agent_store: bool = False  # torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE): rank 0 only connects
    restart_count: int = 0  # this rank's restarts (TORCHELASTIC_RESTART_COUNT): > 0 rejoins a formed world
    joining: bool = False  # a process of a launcher started later (POPMESH_JOIN=1): joins a formed world
    min_nodes: int | None = None  # an elastic world's MIN nodes (POPMESH_MIN_NODES): it stops below them


def _int_var(environ: Mapping[str, str], name: str, *, required: bool) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        if required:
            raise ConfigError(f"{name} is not set: launch with `popmesh launch -n N script.py` or torchrun")
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _port(environ: Mapping[str, str], *, required: bool) -> int:
    """MASTER_PORT, validated whenever it is set (0 when unset in a world of one: any free port)."""
    raw = environ.get("MASTER_PORT")
    if not raw:
        _int_var(environ, "MASTER_PORT", required=required)  # the "is not set" error
        return 0
    if not raw.strip().isdecimal() or not 0 < int(raw) < 65536:
        raise ConfigError(f"MASTER_PORT={raw!r} is not a TCP port: set it to an integer from 1 to 65535 (a port "
                          "free on MASTER_ADDR's host)")
    return int(raw)


def read_torch_env(environ: Mapping[str, str] | None = None) -> TorchEnv:
    """Validate RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (and popmesh's POPMESH_STORE_FD); under
    ``srun`` without them, the task's Slurm variables give them (:mod:`popmesh.core.slurm`)."""
    environ = os.environ if environ is None else environ
    if not environ.get("RANK") and not environ.get("WORLD_SIZE"):
        task = read_slurm(environ)
        if task is not None:
            environ = {**environ, **task.torch_variables(environ)}
    rank = _int_var(environ, "RANK", required=True)
    size = _int_var(environ, "WORLD_SIZE", required=True)
    assert rank is not None and size is not None
    if size < 1:
        raise ConfigError(f"WORLD_SIZE={size} must be at least 1")
    if not 0 <= rank < size:
        raise ConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={size})")
    port = _port(environ, required=size > 1)
    local_rank = _int_var(environ, "LOCAL_RANK", required=False)
    local_size = _int_var(environ, "LOCAL_WORLD_SIZE", required=False)
    if local_rank is not None and local_size is not None and not 0 <= local_rank < local_size:
        raise ConfigError(f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE={local_size})")
    return TorchEnv(
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_world_size=local_size,
        master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
        master_port=port,
        store_fd=_int_var(environ, "POPMESH_STORE_FD", required=False),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true",
        restart_count=_int_var(environ, "TORCHELASTIC_RESTART_COUNT", required=False) or 0,
        joining=environ.get("POPMESH_JOIN", "").strip() == "1",
        min_nodes=_int_var(environ, "POPMESH_MIN_NODES", required=False),
    )


def read_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Default timeout of blocking calls in seconds: ``POPMESH_TIMEOUT`` or 300."""
    environ = os.environ if environ is None else environ
    raw = environ.get("POPMESH_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"POPMESH_TIMEOUT={raw!r} is not a number of seconds") from None
    return check_timeout(value, "POPMESH_TIMEOUT")


_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")


def launcher_world_size(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """``(variable, size)``: the world size the launcher that started this process announced (MPI's
    process managers, or Slurm's ``srun``), or None when none did."""
    environ = os.environ if environ is None else environ
    for name in _SIZE_VARIABLES:
        raw = environ.get(name, "")
        if raw.strip().isdecimal():
            return name, int(raw)
    task = read_slurm(environ)
    return ("SLURM_NTASKS", task.world_size) if task is not None else None


def launcher_restarts(environ: Mapping[str, str] | None = None) -> int:
    """The per-rank restart budget ``popmesh launch --max-restarts N`` gave this process (0 without one,
    and under other launchers: torchrun restarts the whole world, so nobody re-forms)."""
    environ = os.environ if environ is None else environ
    raw = environ.get("TORCHELASTIC_MAX_RESTARTS", "").strip()
    return int(raw) if raw.isdecimal() and environ.get("POPMESH_ENGINE") == "torch" else 0


def launcher_elastic(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``popmesh launch --nnodes MIN:MAX`` started this process on the torch engine: its world may
    grow (later launchers' ranks join) and shrink (ranks leave for good)."""
    environ = os.environ if environ is None else environ
    return environ.get("POPMESH_MIN_NODES", "").strip().isdecimal() and environ.get("POPMESH_ENGINE") == "torch"


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times the launcher started this process again (``TORCHELASTIC_RESTART_COUNT``): 0 in its
    first life; under ``popmesh launch --engine mpi --max-restarts N`` and torchrun, the whole job's
    restarts. ConfigError for a value that is not a whole number."""
    environ = os.environ if environ is None else environ
    count = _int_var(environ, "TORCHELASTIC_RESTART_COUNT", required=False) or 0
    if count < 0:
        raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={count} is negative: the launcher counts restarts from 0")
    return count


def read_number(name: str, default: float, *, hint: str, whole: bool = False,
                environ: Mapping[str, str] | None = None) -> float:
    """Setting ``name`` from the environment: a finite number ≥ 0 (``whole``: an integer), ``default``
    when unset; ConfigError with ``hint`` (what to give) otherwise."""
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw:
        return default
    try:
        value: float = int(raw) if whole else float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:  # NaN fails too
        raise ConfigError(f"{name}={raw!r}: {hint}")
    return value


def read_check(environ: Mapping[str, str] | None = None) -> bool:
    """Whether check mode is on: ``POPMESH_CHECK=1``."""
    environ = os.environ if environ is None else environ
    return environ.get("POPMESH_CHECK", "").strip().lower() in {"1", "true", "yes", "on"}
