"""Build the MPI engine's C parts next to their sources: ``python -m popmesh.engines.mpi.build_native``.

``_native.c`` is the transport's small-message path (:mod:`popmesh.engines.mpi.native`), ``_reduce.c``
the in-window all-reduce's arithmetic (:mod:`popmesh.engines.mpi.shared_reduce`).

The compiler is zig's C compiler from the ``ziglang`` wheel, so a fresh machine needs nothing beyond
what pip installs; ``_native``'s MPI headers and library are the ``mpich`` wheel's (``mpi.h``,
``libmpi.so.12``, the library mpi4py loads), the other headers numpy's and Python's own. ``make``
runs this after installing; it rebuilds only when a source or one of those inputs changed, and
prints why it skips where MPI or the compiler is missing (popmesh then uses the Python path: see
:mod:`popmesh.engines.mpi.native`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

__all__ = ["EXTENSIONS", "build", "main"]

HERE = Path(__file__).resolve().parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
EXTENSIONS = ("_native", "_reduce")  # the small messages' path (needs MPI), the in-window reduce's arithmetic


def _target(name: str) -> Path:
    return HERE / f"{name}{SUFFIX}"


def _stamp(name: str) -> Path:
    """What the library was built from: it is rebuilt when this changes."""
    target = _target(name)
    return target.with_name(target.name + ".inputs")


def _inputs(name: str) -> tuple[list[str], str] | str:
    """The compiler command for extension ``name`` and a fingerprint of everything it reads, or why it
    cannot be built here."""
    source = HERE / f"{name}.c"
    if not source.is_file():
        return f"its source {source} is not part of this installation"
    if importlib.util.find_spec("ziglang") is None:
        return "the zig compiler is not installed (pip install ziglang; popmesh[mpi] brings it)"
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        return f"Python's headers are not in {python_include}"
    command = [sys.executable, "-m", "ziglang", "cc", "-shared", "-fPIC", "-O2", "-Wall", f"-I{python_include}",
               str(source)]
    read, versions = [source], [sys.version]
    if name == "_native":
        if importlib.util.find_spec("mpi4py") is None or importlib.util.find_spec("numpy") is None:
            return "mpi4py or numpy is not installed"
        prefix = Path(sys.prefix)
        header, library = prefix / "include" / "mpi.h", prefix / "lib" / "libmpi.so.12"
        if not header.is_file() or not library.is_file():
            return f"the MPICH wheel's {header} and {library} are not there (pip install mpich)"
        import numpy

        versions.append(numpy.__version__)
        command += [f"-I{numpy.get_include()}", f"-I{header.parent}", str(library), f"-Wl,-rpath,{library.parent}",
                    "-ldl"]
        read += [header, library]
    digest = hashlib.sha256()
    for part in (*command, *versions):
        digest.update(part.encode())
    for path in read:
        digest.update(path.read_bytes())
    return command, digest.hexdigest()


def build(force: bool = False) -> str:
    """Build each extension that is missing or stale; what was done, as one line."""
    said = []
    for name in EXTENSIONS:
        inputs = _inputs(name)
        if isinstance(inputs, str):
            said.append(f"{name} not built ({inputs}; the Python path runs instead)")
            continue
        command, fingerprint = inputs
        target, stamp = _target(name), _stamp(name)
        if not force and target.is_file() and stamp.is_file() and stamp.read_text() == fingerprint:
            said.append(f"{name} up to date")
            continue
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise SystemExit(f"popmesh: building {name} failed:\n{' '.join(command)}\n{done.stderr[-4000:]}")
        os.replace(partial, target)  # a process that loaded the old library keeps its own copy
        stamp.write_text(fingerprint)
        said.append(f"built {name}")
    return "popmesh: MPI C parts: " + "; ".join(said)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(build(force="--force" in args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
