"""``popmesh info``: versions, available engines and the distributed variables this process sees.

Paste its output into a bug report (like ``accelerate env``). Engines are detected with
``importlib.util.find_spec``; the packages are imported only here, to read their versions.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

from popmesh.core.errors import ConfigError
from popmesh.core.launch_env import detect_engine, launcher_world_size
from popmesh.core.slurm import read_slurm
from popmesh.engines import mpi_library_version, mpi_native_status

__all__ = ["collect_info", "format_info", "distributed_env", "detected_launch", "ENV_PREFIXES", "ENV_NAMES"]

ENV_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "POPMESH_", "JAX_", "TORCHELASTIC_", "SLURM_")
_ENGINE_PACKAGES = {"torch": "torch", "mpi": "mpi4py", "jax": "jax"}


def _version(package: str) -> str | None:
    """The package's ``__version__`` (imported here only), or None if it is not installed."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return str(getattr(importlib.import_module(package), "__version__", "unknown"))
    except Exception as e:
        return f"broken ({type(e).__name__}: {e})"


def _installed_version(distribution: str) -> str:
    """The installed distribution's version from its metadata (no import of the package itself)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _engine_available(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def distributed_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that decide how a world forms, sorted by name."""
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def detected_launch(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What ``popmesh.init()`` would make of this environment: the engine, and who launched us."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    try:
        out["engine"] = detect_engine(env)
    except ConfigError as e:
        out["engine"] = f"none: {e}"
    announced = launcher_world_size(env)
    task = None
    try:
        task = read_slurm(env)
    except ConfigError as e:
        out["slurm"] = f"unreadable: {e}"
    if env.get("RANK") and env.get("WORLD_SIZE"):
        if env.get("POPMESH_ERROR_FILE"):  # set by popmesh launch, not by torchrun
            out["launcher"] = "popmesh launch"
        elif env.get("TORCHELASTIC_RUN_ID"):
            out["launcher"] = "torchrun"
        else:
            out["launcher"] = "RANK/WORLD_SIZE set by hand or another launcher"
        out["rank"], out["world_size"] = env["RANK"], env["WORLD_SIZE"]
    elif announced is not None and announced[0] != "SLURM_NTASKS":
        out["launcher"] = f"an MPI process manager ({announced[0]}={announced[1]})"
    elif task is not None:
        out["launcher"] = "slurm (srun)"
        out["rank"], out["world_size"] = task.rank, task.world_size
        out["nodes"] = ",".join(task.nodes) or "(no node list)"
        variables = task.torch_variables(env)
        out["master"] = f"{variables['MASTER_ADDR']}:{variables['MASTER_PORT']}"
    else:
        out["launcher"] = "none: a world of one"
    return out


def _mpi_c_path() -> dict[str, str] | None:
    """The MPI transport's C path: its state (in use, ready, not built, refused, off) and why."""
    status = mpi_native_status()
    return None if status is None else {"state": status[0], "reason": status[1]}


def collect_info(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything ``popmesh info`` prints, as plain data."""
    versions = {
        "python": platform.python_version(),
        "popmesh": _installed_version("popmesh"),
        "torch": _version("torch"),
        "mpi4py": _version("mpi4py"),
        "mpi_library": mpi_library_version(),
        "jax": _version("jax"),
    }
    return {
        "platform": platform.platform(),
        "python_executable": sys.executable,
        "versions": versions,
        "engines": {name: _engine_available(pkg) for name, pkg in _ENGINE_PACKAGES.items()},
        "mpi_c_path": _mpi_c_path(),
        "cpu_count": os.cpu_count(),
        "environment": distributed_env(env),
        "detected": detected_launch(env),
    }


def format_info(info: Mapping[str, Any], *, as_json: bool = False) -> str:
    """Text for a terminal (aligned ``- key: value`` lines) or JSON."""
    if as_json:
        return json.dumps(info, indent=2, sort_keys=True)
    lines = [f"- platform: {info['platform']}", f"- python executable: {info['python_executable']}"]
    lines += [f"- {name} version: {value or 'not installed'}" for name, value in info["versions"].items()]
    engines = ", ".join(f"{name} ({'yes' if ok else 'no'})" for name, ok in info["engines"].items())
    lines += [f"- engines available: {engines}"]
    c_path = info.get("mpi_c_path")
    lines += [f"- MPI C path: {c_path['state']} ({c_path['reason']})" if c_path else "- MPI C path: no mpi4py"]
    lines += [f"- cpu count: {info['cpu_count']}"]
    lines += [f"- detected {key.replace('_', ' ')}: {value}" for key, value in info.get("detected", {}).items()]
    lines += ["- distributed environment:"]
    env = info["environment"]
    lines += [f"    {k}={v}" for k, v in env.items()] or ["    (none set)"]
    return "\n".join(lines)
