"""Build the MPI engine's C parts: ``python -m popmesh.engines.mpi.build_native``.

``_native.c`` is the transport's small-message path (:mod:`popmesh.engines.mpi.native`), ``_reduce.c``
the in-window all-reduce's arithmetic (:mod:`popmesh.engines.mpi.shared_reduce`).

The compiler is zig's C compiler from the ``ziglang`` wheel, so a fresh machine needs nothing beyond
what pip installs; ``_native``'s MPI headers and library are the ``mpich`` wheel's (``mpi.h``,
``libmpi.so.12``, the library mpi4py loads), the other headers numpy's and Python's own.

Two callers share the plan made here:

- the package build (``setup.py``): ``pip install popmesh[mpi]`` and ``python -m build`` compile both
  parts for a portable CPU (``POPMESH_NATIVE_CPU``, default ``baseline``: a wheel runs on other
  machines), an editable install for this CPU, with a run path relative to the installed module;
- this command (``make`` runs it): builds next to the sources, or next to an installed package, for
  the CPU it runs on, rebuilding only when a source or one of its inputs changed.

Where the compiler, the headers or MPICH are missing, both say why and build nothing: popmesh then
runs its Python path (:mod:`popmesh.engines.mpi.native`). This module imports only the standard
library at the top, so ``setup.py`` can load it from the source tree before popmesh is installed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EXTENSIONS", "Plan", "plan", "compile_extension", "build", "main", "mpich_files", "INSTALLED_RUNPATH"]

HERE = Path(__file__).resolve().parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
EXTENSIONS = ("_native", "_reduce")  # the small messages' path (needs MPI), the in-window reduce's arithmetic
# From site-packages/popmesh/engines/mpi to <prefix>/lib, where the mpich wheel puts libmpi.so.12. The
# library is found without it too whenever mpi4py has loaded it first (the loader always does).
INSTALLED_RUNPATH = "$ORIGIN/../../../../.."


@dataclass(frozen=True)
class Plan:
    """How to compile one extension: the command (output path appended last) and a fingerprint of
    everything it reads, so an unchanged build can be skipped."""

    name: str
    command: list[str]
    fingerprint: str


def mpich_files() -> tuple[Path, Path] | str:
    """The mpich wheel's ``mpi.h`` and ``libmpi.so.12``, wherever pip put them (a venv, a user
    site, an isolated build environment), or why they cannot be found."""
    try:
        distribution = importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return "the mpich wheel is not installed (pip install mpich; popmesh[mpi] brings it)"
    found: dict[str, Path] = {}
    for file in distribution.files or ():
        if file.name in ("mpi.h", "libmpi.so.12") and file.name not in found:
            found[file.name] = Path(str(distribution.locate_file(file))).resolve()
    header, library = found.get("mpi.h"), found.get("libmpi.so.12")
    if header is None or library is None or not header.is_file() or not library.is_file():
        return f"the mpich wheel {distribution.version} lacks mpi.h or libmpi.so.12 (MPICH on this platform?)"
    return header, library


def plan(name: str, *, cpu: str = "native", runpath: str | None = None) -> Plan | str:
    """The compile plan of extension ``name`` for ``cpu`` (zig's ``-mcpu``), or why it cannot be built
    here. ``runpath`` is where the linked MPI library is looked for at run time: None means the
    directory it was found in now (a build in place), :data:`INSTALLED_RUNPATH` a wheel's layout."""
    source = HERE / f"{name}.c"
    if not source.is_file():
        return f"its source {source} is not part of this installation"
    if importlib.util.find_spec("ziglang") is None:
        return "the zig compiler is not installed (pip install ziglang; popmesh[mpi] brings it)"
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        return f"Python's headers are not in {python_include}"
    command = [sys.executable, "-m", "ziglang", "cc", "-shared", "-fPIC", "-O2", "-Wall", f"-mcpu={cpu}",
               f"-I{python_include}", str(source)]
    read, versions = [source], [sys.version]
    if name == "_native":
        if importlib.util.find_spec("numpy") is None:
            return "numpy is not installed"
        files = mpich_files()
        if isinstance(files, str):
            return files
        header, library = files
        import numpy

        versions.append(numpy.__version__)
        command += [f"-I{numpy.get_include()}", f"-I{header.parent}", str(library),
                    f"-Wl,-rpath,{runpath or library.parent}", "-ldl"]
        read += [header, library]
    digest = hashlib.sha256()
    for part in (*command, *versions):
        digest.update(part.encode())
    for path in read:
        digest.update(path.read_bytes())
    return Plan(name, command, digest.hexdigest())


def compile_extension(planned: Plan, target: Path) -> str | None:
    """Compile ``planned`` into ``target`` (replaced whole, never half-written); None, or the
    compiler's error."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run([*planned.command, "-o", str(partial)], capture_output=True, text=True)
    except OSError as e:
        return f"the compiler could not be started: {e}"
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return f"{' '.join(planned.command)}\n{done.stderr[-4000:]}"
    os.replace(partial, target)  # a process that loaded the old library keeps its own copy
    return None


def _target(name: str) -> Path:
    return HERE / f"{name}{SUFFIX}"


def _stamp(name: str) -> Path:
    """What the library was built from: it is rebuilt when this changes."""
    target = _target(name)
    return target.with_name(target.name + ".inputs")


def build(force: bool = False, cpu: str = "native") -> str:
    """Build each extension next to its source that is missing or stale; what was done, as one line."""
    said = []
    for name in EXTENSIONS:
        planned = plan(name, cpu=cpu)
        if isinstance(planned, str):
            said.append(f"{name} not built ({planned}; the Python path runs instead)")
            continue
        target, stamp = _target(name), _stamp(name)
        if not force and target.is_file() and stamp.is_file() and stamp.read_text() == planned.fingerprint:
            said.append(f"{name} up to date")
            continue
        error = compile_extension(planned, target)
        if error is not None:
            raise SystemExit(f"popmesh: building {name} failed:\n{error}")
        stamp.write_text(planned.fingerprint)
        said.append(f"built {name}")
    return "popmesh: MPI C parts: " + "; ".join(said)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m popmesh.engines.mpi.build_native",
                                     description="Build the MPI engine's C parts next to their sources.")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--cpu", default="native", help="zig's -mcpu (default: native, this machine's CPU)")
    ns = parser.parse_args(argv)
    print(build(force=ns.force, cpu=ns.cpu))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
