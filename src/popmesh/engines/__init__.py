"""Engine adapters behind one Protocol. Each adapter imports its own engine, and only when created."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from popmesh.core.errors import ConfigError, EngineUnavailable
from popmesh.core.launch_env import launcher_world_size, read_torch_env
from popmesh.engines import failing
from popmesh.engines.base import Engine, GroupSpec

__all__ = ["Engine", "GroupSpec", "create_engine", "available_engines", "mpi_module", "mpi_library_version",
           "mpi_native_status"]

_PACKAGES = {"local": None, "torch": "torch", "mpi": "mpi4py"}


def available_engines() -> list[str]:
    """Engines whose packages are importable here (checked without importing them)."""
    return [name for name, pkg in _PACKAGES.items() if pkg is None or importlib.util.find_spec(pkg) is not None]


def create_engine(name: str, timeout: float, **options: Any) -> Engine:
    """Start the named engine (``local``, ``torch`` or ``mpi``) from the environment. In a world of two
    or more, an uncaught exception then takes the world down (:mod:`popmesh.engines.failing`)."""
    engine = _start(name, timeout, **options)
    if engine.size > 1:
        failing.install()
    return engine


def _start(name: str, timeout: float, **options: Any) -> Engine:
    if name == "local":
        from popmesh.engines.local import LocalEngine

        return LocalEngine()
    if name == "torch":
        from popmesh.engines.torch.engine import TorchEngine

        return TorchEngine(read_torch_env(), timeout, backend=options.get("backend"),
                           fingerprint=options.get("fingerprint"))
    if name == "mpi":
        from popmesh.engines.mpi.engine import MpiEngine

        engine = MpiEngine()
        _check_size(engine.size, "MPI")
        return engine
    raise ConfigError(f"unknown engine {name!r}: use 'auto', 'local', 'torch' or 'mpi'")


def _check_size(size: int, formed_by: str) -> None:
    """ConfigError unless the world that formed has the size its launcher announced."""
    announced = launcher_world_size()
    if announced is None or announced[1] == size:
        return
    name, expected = announced
    raise ConfigError(
        f"the launcher started a world of {expected} ({name}={expected}) but {formed_by} formed a world of {size}: "
        "mpi4py is built against another MPI than the one that launched this process (for example mpi4py with "
        "the MPICH wheel under Open MPI's mpirun, or under srun without --mpi=pmi2/pmix). Launch with the "
        "matching mpiexec (`popmesh launch --engine mpi`), or install mpi4py built for your MPI: "
        "pip install 'popmesh[mpi-system]' --no-binary mpi4py")


def mpi_module() -> Any:
    """mpi4py's ``MPI`` module, imported (and MPI initialised) on first use; EngineUnavailable without it."""
    if importlib.util.find_spec("mpi4py") is None:
        raise EngineUnavailable("mpi4py is not installed: pip install 'popmesh[mpi]'")
    from mpi4py import MPI

    return MPI


def _mpi_uninitialised() -> Any:
    """mpi4py's ``MPI`` module, loaded without initialising MPI when nothing has yet (MPI-3 allows
    querying the library before MPI_Init)."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI


def mpi_native_status() -> tuple[str, str] | None:
    """The MPI C path's (state, reason) in this process, as
    :func:`popmesh.engines.mpi.native.native_status` gives it (None without mpi4py)."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    from popmesh.engines.mpi.native import native_status

    try:
        return native_status(_mpi_uninitialised())
    except Exception as e:
        return "unknown", f"{type(e).__name__}: {e}"


def mpi_library_version() -> str | None:
    """First line of ``MPI.Get_library_version()`` (None without mpi4py). Loads MPI without
    initialising it when nothing has yet (MPI-3 allows the query before MPI_Init)."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    try:
        return str(_mpi_uninitialised().Get_library_version()).strip().splitlines()[0]
    except Exception as e:
        return f"unavailable ({type(e).__name__}: {e})"
