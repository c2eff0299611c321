"""The package build's one custom step: compiling the MPI engine's C parts with zig's compiler.

Everything else about the package is in pyproject.toml. The plan (compiler, flags, MPICH's header and
library) is :mod:`popmesh.engines.mpi.build_native`'s, shared with ``make``. A part that cannot be
compiled here is left out with its reason: the wheel still installs, and popmesh runs the Python
path, whose reason ``popmesh info`` shows (it is recorded in ``engines/mpi/build_report.txt``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "src" / "popmesh" / "engines" / "mpi"


def _load_plan_module():
    """``build_native`` from the source tree (it imports only the standard library at the top)."""
    spec = importlib.util.spec_from_file_location("_popmesh_build_native", PACKAGE / "build_native.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


class BuildWithZig(build_ext):
    """Compile each C part with the plan ``build_native`` makes; skip it, saying why, where it can't."""

    def run(self) -> None:
        native = _load_plan_module()
        # A wheel runs on other machines (a portable CPU); an editable install in place, on this one.
        cpu = os.environ.get("POPMESH_NATIVE_CPU", "native" if self.inplace else "baseline")
        report = []
        for extension in self.extensions:
            name = extension.name.rsplit(".", 1)[-1]
            target = Path(self.get_ext_fullpath(extension.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            planned = native.plan(name, cpu=cpu, runpath=native.INSTALLED_RUNPATH)
            error = planned if isinstance(planned, str) else native.compile_extension(planned, target)
            if error is None:
                report.append(f"{name}: built for -mcpu={cpu}")
                if self.inplace:  # what make's build compares with: its own plan differs, so it rebuilds once
                    target.with_name(target.name + ".inputs").write_text(planned.fingerprint)
            else:
                report.append(f"{name}: not built at install time: {error.splitlines()[0]}")
                print(f"popmesh: the MPI C part {name} was not built ({error}); popmesh runs its Python path. "
                      "Build it later with `python -m popmesh.engines.mpi.build_native`.", file=sys.stderr)
        where = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        (where / "build_report.txt").write_text("\n".join(report) + "\n")


setup(
    ext_modules=[Extension(f"popmesh.engines.mpi.{name}", sources=[f"src/popmesh/engines/mpi/{name}.c"])
                 for name in ("_native", "_reduce")],
    cmdclass={"build_ext": BuildWithZig},
)
