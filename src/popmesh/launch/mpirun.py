"""Find ``mpiexec`` and build the command that runs the bootstrap on every MPI rank."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence

from popmesh.core.errors import EngineUnavailable

__all__ = ["find_mpiexec", "is_hydra", "mpi_command", "HYDRA_PREFIX"]

# MPICH's Hydra expands %r to the rank; the output pump parses the same "[rank r] " form.
HYDRA_PREFIX = "[rank %r] "


def find_mpiexec(python: str) -> str:
    """``mpiexec`` next to ``python`` (a virtual environment's own MPI), else the first on PATH."""
    beside = os.path.join(os.path.dirname(python), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if found is None:
        raise EngineUnavailable(
            "--engine mpi needs mpiexec, found neither next to the Python interpreter nor on PATH; "
            "install one with `pip install mpi4py mpich` (or popmesh[mpi])"
        )
    return found


@functools.lru_cache(maxsize=8)
def is_hydra(mpiexec: str) -> bool:
    """True if ``mpiexec`` is MPICH's Hydra, which can prefix every output line with the rank."""
    try:
        probe = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in probe.stdout.upper()


def mpi_command(
    mpiexec: str, nproc: int, worker: Sequence[str], *, hydra: bool, iface: str | None = None, hosts: str = ""
) -> list[str]:
    """``mpiexec -n N [-hosts a:2,b:2] [-prepend-pattern "[rank %r] "] [-iface IFACE] worker...``.

    Without Hydra the lines come through unprefixed (they are still shown and kept). ``iface`` is the
    interface whose address Hydra gives its proxy to connect back to (loopback on one node); Hydra still
    binds that control socket to the wildcard address, which no option of its changes.
    """
    prefix = ["-prepend-pattern", HYDRA_PREFIX] if hydra else []
    interface = ["-iface", iface] if hydra and iface else []
    placement = ["-hosts", hosts] if hosts else []
    return [mpiexec, "-n", str(nproc), *placement, *prefix, *interface, *worker]
