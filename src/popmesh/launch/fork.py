"""``fork(n)``: turn a plain ``python train.py`` into an n-rank world from inside the script.

OmniSafe's ``mpi_fork`` re-runs the program under mpirun; popmesh's version fixes three things:
it works for ``python -m pkg`` as well as for a script (it reads ``sys.orig_argv``, keeping the
interpreter's own options), it knows it is inside a world from the launcher's variables instead of
guessing from ``MASTER_ADDR``, and a failed child world raises instead of being ignored.

Typical use, at the top of a script::

    if popmesh.launch.fork(4):
        sys.exit(0)          # the parent: the 4 ranks have finished successfully
    ...                      # the ranks (and a world of one) continue here
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from popmesh.core.errors import ConfigError
from popmesh.launch.api import launch

__all__ = ["fork", "in_launched_world", "Invocation", "parse_invocation"]

# Set by popmesh launch, torchrun, MPICH/Intel MPI and Open MPI respectively.
_WORLD_VARS = ("POPMESH_ENGINE", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_OPTS_WITH_VALUE = ("-W", "-X")


def in_launched_world(env: Mapping[str, str] | None = None) -> bool:
    """True if this process is a rank started by a launcher (popmesh, torchrun or mpiexec)."""
    env = os.environ if env is None else env
    return any(env.get(name) for name in _WORLD_VARS)


@dataclass(frozen=True)
class Invocation:
    """How this program was started: interpreter options, then a script or ``-m`` module, then args."""

    interpreter_options: tuple[str, ...]
    target: str
    module: bool
    args: tuple[str, ...]


def parse_invocation(orig_argv: Sequence[str]) -> Invocation:
    """Split ``sys.orig_argv`` (``[python, opts..., script|-m mod, args...]``) into its parts."""
    opts: list[str] = []
    i = 1
    while i < len(orig_argv):
        token = orig_argv[i]
        if token in ("-c", "-") or (token.startswith("-c") and not token.startswith("--")):
            raise ConfigError(
                "fork() needs a program started as `python script.py` or `python -m module`, not -c or stdin"
            )
        if token == "-m" or (token.startswith("-m") and len(token) > 2):
            name, rest = (orig_argv[i + 1], i + 2) if token == "-m" else (token[2:], i + 1)
            return Invocation(tuple(opts), name, True, tuple(orig_argv[rest:]))
        if token == "--" or not token.startswith("-"):
            at = i + 1 if token == "--" else i
            if at >= len(orig_argv):
                break
            return Invocation(tuple(opts), orig_argv[at], False, tuple(orig_argv[at + 1 :]))
        takes_value = token in _OPTS_WITH_VALUE
        opts += orig_argv[i : i + 2] if takes_value else [token]
        i += 2 if takes_value else 1
    raise ConfigError("fork() could not find the script or -m module in sys.orig_argv; start the program with python")


def _warn_if_other_size(n: int) -> None:
    for name in _SIZE_VARS:
        size = os.environ.get(name)
        if size and size.isdigit() and int(size) != n:
            warnings.warn(
                f"fork({n}) inside a world of {size} ranks started elsewhere; keeping that world", stacklevel=3
            )
            return


def fork(n: int, *, engine: str = "torch", quiet_others: bool = False, **options: Any) -> bool:
    """Relaunch this program on ``n`` ranks; True in the parent once they all succeeded.

    Returns False in the ranks themselves (the program is already inside a launched world) and
    when ``n == 1`` (nothing to fork). Raises :class:`LaunchFailed` in the parent if a rank failed.
    ``options`` are passed on to :func:`popmesh.launch.launch` (e.g. ``grace=``, ``env=``).
    """
    if n < 1:
        raise ConfigError(f"fork(n) needs n >= 1, got {n}")
    if in_launched_world():
        _warn_if_other_size(n)
        return False
    if n == 1:
        return False
    how = parse_invocation(sys.orig_argv)
    launch(
        how.target,
        how.args,
        nproc=n,
        module=how.module,
        engine=engine,
        quiet_others=quiet_others,
        python=[sys.executable, *how.interpreter_options],
        **options,
    ).check()
    return True
