"""The MPI transport's small messages in C (``_native.c``), where it was built and fits the MPI in use.

A 4-byte round trip through the Python path spent ~10 us of Python per rank around ~2 us of MPI
calls (docs/messages.md): framing, the envelope, mpi4py's request, message and status objects,
the probe loop and the decode. ``_native`` does those steps for a message carried whole in one MPI
message (bytes, or a C-contiguous numpy array of at most 4 KiB, as :func:`~popmesh.wire.encode_message`
frames them) and gives anything else back to the Python path. The bytes on the wire are the same
either way, so a rank with the extension talks to a rank without it.

The package build compiles it (``pip install popmesh[mpi]``), and so does ``make`` for a checkout
(:mod:`popmesh.engines.mpi.build_native`, with the zig C compiler from PyPI).
``POPMESH_MPI_NATIVE``: unset or ``auto`` uses it where it loads; ``0`` never (the Python path,
for comparisons); ``1`` requires it (ConfigError where it cannot be used, with the reason). The
same setting governs ``_reduce``, the in-window all-reduce's arithmetic (:func:`load_reduce`).
:func:`native_status` says which applies and why (``popmesh info`` prints it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from popmesh.core.errors import ConfigError
from popmesh.wire.format import NUMPY_BY_CODE, UINT8_CODE

__all__ = ["load_native", "load_reduce", "native_setting", "native_status", "NativeStatus"]

_CHOICES = {"": "auto", "auto": "auto", "0": "off", "off": "off", "1": "on", "on": "on"}


def native_setting(environ: dict[str, str] | None = None) -> str:
    """``POPMESH_MPI_NATIVE`` as ``"auto"``, ``"off"`` or ``"on"``; ConfigError for anything else."""
    raw = (os.environ if environ is None else environ).get("POPMESH_MPI_NATIVE", "").strip().lower()
    if raw not in _CHOICES:
        raise ConfigError(f"POPMESH_MPI_NATIVE={raw!r}: give 1 (require the C path), 0 (the Python path) or auto")
    return _CHOICES[raw]


class NativeStatus(NamedTuple):
    """Whether the C path is used here: ``state`` is ``"in use"``, ``"ready"`` (built and fitting this
    MPI, which is not started yet), ``"not built"``, ``"refused"`` or ``"off"``; ``reason`` says why."""

    state: str
    reason: str


def native_status(mpi: Any) -> NativeStatus:
    """The C path's status for mpi4py's ``MPI`` module ``mpi`` (initialised or not); loads nothing
    into a process whose MPI is not the MPICH it is built for."""
    if native_setting() == "off":
        return NativeStatus("off", "POPMESH_MPI_NATIVE=0 chooses the Python path")
    state, why = _unusable(mpi)
    if why is not None:
        return NativeStatus(state, why)
    if not mpi.Is_initialized():
        return NativeStatus("ready", "built for this MPI; used once MPI starts with MPI_THREAD_MULTIPLE")
    module, why = _bound(mpi)
    return NativeStatus("in use", "small messages go through the C path") if module else NativeStatus("refused", why)


def load_native(mpi: Any) -> Any | None:
    """The ``_native`` module bound to this process's MPI, or None where the Python path is to be used."""
    setting = native_setting()
    if setting == "off":
        return None
    _, why = _unusable(mpi)
    if why is None:
        module, why = _bound(mpi)
        if module is not None:
            return module
    if setting == "on":
        raise ConfigError(f"POPMESH_MPI_NATIVE=1 but the C path cannot be used: {why}. Install popmesh[mpi] (its "
                          "build compiles the C parts), or build them in place with `python -m "
                          "popmesh.engines.mpi.build_native` (make does), or unset POPMESH_MPI_NATIVE")
    return None


def load_reduce() -> Any | None:
    """The ``_reduce`` module (the in-window all-reduce's arithmetic in one pass, the same bits as
    numpy's), or None where numpy is to do it: not built, or ``POPMESH_MPI_NATIVE=0``."""
    setting = native_setting()
    if setting == "off":
        return None
    try:
        from popmesh.engines.mpi import _reduce  # type: ignore[attr-defined]
    except ImportError as e:
        if setting == "on":
            raise ConfigError(f"POPMESH_MPI_NATIVE=1 but the in-window reduce's C part is not built ({e}): install "
                              "popmesh[mpi] (its build compiles it) or build it in place with `python -m "
                              "popmesh.engines.mpi.build_native` (make does)") from e
        return None
    return _reduce


def _bound(mpi: Any) -> tuple[Any | None, str]:
    """``_native`` bound to XXH3, the dtypes and this process's initialised MPI, or why it cannot be."""
    import xxhash._xxhash  # type: ignore[import-not-found]  # the wheel's extension: XXH3_64bits lives there

    from popmesh.engines.mpi import _native  # type: ignore[attr-defined]

    dtypes = {code: dtype for code, dtype in NUMPY_BY_CODE.items() if dtype.isnative}
    try:
        version = _native.bind(xxhash._xxhash.__file__, dtypes, UINT8_CODE, mpi.Exception)
    except (ImportError, OSError, ValueError, TypeError) as e:
        return None, f"it could not load what it needs ({e})"
    if version != mpi.Get_library_version() or not _native.initialized():
        return None, "it sees another MPI library than mpi4py's (it is built against the MPICH wheel)"
    return _native, ""


def _unusable(mpi: Any) -> tuple[str, str | None]:
    """Why the extension cannot be used here (with the state that names it), or None (checked before
    the extension, and the MPICH library it links, are loaded into a process that runs another MPI)."""
    version = str(mpi.Get_library_version())
    if not version.startswith("MPICH"):
        return "refused", f"it is built for the MPICH wheel, and this MPI is {version.splitlines()[0].strip()!r}"
    try:
        from popmesh.engines.mpi import _native  # type: ignore[attr-defined]  # noqa: F401
    except ImportError as e:
        said = _build_report("_native")
        return "not built", f"no compiled _native here ({f'the package build said: {said}' if said else e})"
    initialized = getattr(mpi, "Is_initialized", lambda: True)()
    if initialized and mpi.Query_thread() != mpi.THREAD_MULTIPLE:
        return "refused", "MPI was not initialised with MPI_THREAD_MULTIPLE (its receive spins with the GIL released)"
    return "", None


def _build_report(name: str) -> str:
    """Why the package build left out the C part ``name``, as it recorded it, or ``""``."""
    try:
        lines = Path(__file__).with_name("build_report.txt").read_text().splitlines()
    except OSError:
        return ""
    prefix = f"{name}: not built at install time: "
    return next((line[len(prefix):] for line in lines if line.startswith(prefix)), "")
