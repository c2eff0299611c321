"""Build the MPI transport's C path (``_native.c``) next to its source: ``python -m popmesh.engines.mpi.build_native``.

The compiler is zig's C compiler from the ``ziglang`` wheel, so a fresh machine needs nothing beyond
what pip installs; the headers and library are the ``mpich`` wheel's (``mpi.h``, ``libmpi.so.12``, the
library mpi4py loads), numpy's and Python's own. ``make`` runs this after installing; it rebuilds only
when the source or one of those inputs changed, and prints why it skips where MPI or the compiler is
missing (popmesh then uses the Python path: see :mod:`popmesh.engines.mpi.native`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

__all__ = ["build", "main"]

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_native.c"
TARGET = HERE / f"_native{sysconfig.get_config_var('EXT_SUFFIX')}"
STAMP = TARGET.with_name(TARGET.name + ".inputs")  # what the library was built from (rebuild when it changes)


def _inputs() -> tuple[list[str], str] | str:
    """The compiler command and a fingerprint of everything it reads, or why it cannot build here."""
    if importlib.util.find_spec("ziglang") is None:
        return "the zig compiler is not installed (pip install ziglang; popmesh[mpi] brings it)"
    if importlib.util.find_spec("mpi4py") is None or importlib.util.find_spec("numpy") is None:
        return "mpi4py or numpy is not installed"
    prefix = Path(sys.prefix)
    header, library = prefix / "include" / "mpi.h", prefix / "lib" / "libmpi.so.12"
    if not header.is_file() or not library.is_file():
        return f"the MPICH wheel's {header} and {library} are not there (pip install mpich)"
    import numpy

    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").is_file():
        return f"Python's headers are not in {python_include}"
    command = [sys.executable, "-m", "ziglang", "cc", "-shared", "-fPIC", "-O2", "-Wall",
               f"-I{python_include}", f"-I{numpy.get_include()}", f"-I{header.parent}", str(SOURCE), str(library),
               f"-Wl,-rpath,{library.parent}", "-ldl"]
    digest = hashlib.sha256()
    for part in (*command, numpy.__version__, sys.version):
        digest.update(part.encode())
    for path in (SOURCE, header, library):
        digest.update(path.read_bytes())
    return command, digest.hexdigest()


def build(force: bool = False) -> str:
    """Build the extension if it is missing or stale; what was done, as one line."""
    inputs = _inputs()
    if isinstance(inputs, str):
        return f"popmesh: MPI C path not built ({inputs}); MPI messages take the Python path"
    command, fingerprint = inputs
    if not force and TARGET.is_file() and STAMP.is_file() and STAMP.read_text() == fingerprint:
        return f"popmesh: MPI C path up to date ({TARGET.name})"
    partial = TARGET.with_name(f"{TARGET.name}.{os.getpid()}.tmp")
    done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"popmesh: building the MPI C path failed:\n{' '.join(command)}\n{done.stderr[-4000:]}")
    os.replace(partial, TARGET)  # a process that loaded the old library keeps its own copy
    STAMP.write_text(fingerprint)
    return f"popmesh: built the MPI C path ({TARGET.name})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(build(force="--force" in args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
