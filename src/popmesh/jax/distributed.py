"""Multi-process JAX: bring up ``jax.distributed`` from what ``popmesh launch --engine jax`` set.

The launcher gives every rank ``JAX_COORDINATOR_ADDRESS`` (host:port), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID``. :func:`init` reads them (or explicit arguments), selects gloo for CPU
collectives (XLA's CPU backend has none by default), and initialises JAX once. Outside a launched
world it is a no-op, so the same script runs on one process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import jax
from popmesh.core.errors import ConfigError
from popmesh.core.timeouts import check_timeout

__all__ = ["JaxProcess", "read_jax_env", "init", "is_initialized", "shutdown"]

_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclass(frozen=True)
class JaxProcess:
    """This process's place in a multi-process JAX run."""

    coordinator_address: str | None
    num_processes: int
    process_id: int

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1


def read_jax_env(environ: Mapping[str, str] | None = None) -> JaxProcess:
    """The launcher's JAX variables, validated; a single process when none is set."""
    environ = os.environ if environ is None else environ
    present = [name for name in _VARS if environ.get(name)]
    if not present:
        return JaxProcess(None, 1, 0)
    if len(present) != len(_VARS):
        missing = sorted(set(_VARS) - set(present))
        raise ConfigError(f"{', '.join(missing)} not set: launch with `popmesh launch --engine jax -n N script.py`")
    try:
        count, index = int(environ["JAX_NUM_PROCESSES"]), int(environ["JAX_PROCESS_ID"])
    except ValueError:
        raise ConfigError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"JAX_PROCESS_ID={index} must be in [0, JAX_NUM_PROCESSES={count})")
    return JaxProcess(environ["JAX_COORDINATOR_ADDRESS"], count, index)


def init(coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None,
         *, cpu_collectives: str = "gloo", timeout: float = 300.0) -> JaxProcess:
    """Initialise ``jax.distributed`` once (idempotent); returns where this process stands.

    Must run before the first JAX computation. Explicit arguments override the environment.
    """
    env = read_jax_env()
    process = JaxProcess(
        coordinator_address or env.coordinator_address,
        env.num_processes if num_processes is None else int(num_processes),
        env.process_id if process_id is None else int(process_id),
    )
    if not process.distributed or jax.distributed.is_initialized():
        return process
    if process.coordinator_address is None:
        raise ConfigError("a multi-process JAX run needs a coordinator address (JAX_COORDINATOR_ADDRESS)")
    # Only the CPU backend reads this; set it before anything initialises a backend.
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)  # type: ignore[no-untyped-call]  # jax: config.update is unannotated
    jax.distributed.initialize(
        process.coordinator_address, process.num_processes, process.process_id,
        initialization_timeout=math.ceil(check_timeout(timeout, what="popmesh.jax.init")),
    )
    return process


def is_initialized() -> bool:
    """Whether ``jax.distributed.initialize()`` has run in this process (by :func:`init` or directly)."""
    return bool(jax.distributed.is_initialized())


def shutdown() -> None:
    """Leave the multi-process run (no-op when not initialised)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()  # type: ignore[no-untyped-call]  # jax: distributed.shutdown is unannotated
