"""Worker side of world tests: register checks, run them all in one world, report per rank.

Each rank keeps ``rank<r>.json`` in ``POPMESH_TEST_OUT`` up to date: the outcome of every check run so
far ("ok", "skipped: why", or the error and its traceback) and the check it is running now, so a
rank that dies is known to have died in that check. A failing check also leaves a ``failed-rank<r>``
marker; under ``POPMESH_TEST_FAIL_FAST=1`` (the harness's default) the rank then stops and waits for
the harness, which takes the whole world down at once instead of leaving the peers waiting in a
collective until their timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable

_REGISTRY: dict[str, dict[str, Callable]] = {}
SKIPPED = "skipped: "


class CheckSkipped(Exception):
    """Raised by :func:`skip`: the check does not apply to this world (the reason says why)."""


def check(fn: Callable) -> Callable:
    """Register ``fn(world)`` as a check of its module; it passes if it returns without raising."""
    _REGISTRY.setdefault(fn.__module__, {})[fn.__name__] = fn
    return fn


def checks_of(module) -> list[str]:
    """Names of the checks a worker module registered, in order."""
    return list(_REGISTRY.get(module.__name__, {}))


def skip(reason: str) -> None:
    """End the running check as skipped on this rank, saying why (reported by pytest as a skip)."""
    raise CheckSkipped(reason)


def need_ranks(world, n: int) -> None:
    """Skip the running check in a world of fewer than ``n`` ranks."""
    if world.size < n:
        skip(f"needs at least {n} ranks, this world has {world.size}")


class _Report:
    """This rank's result file, rewritten (atomically) before and after every check."""

    def __init__(self, rank: int) -> None:
        self.out = os.environ.get("POPMESH_TEST_OUT")
        self.rank = rank
        self.outcomes: dict[str, str] = {}
        self.seconds: dict[str, float] = {}  # each check's wall time on this rank, to find slow ones

    def write(self, running: str | None) -> None:
        self._replace(f"rank{self.rank}.json", {"outcomes": self.outcomes, "running": running,
                                                 "seconds": self.seconds})

    def failed(self, name: str) -> None:
        """Record the failure, then leave the marker the harness watches for."""
        self.write(None)
        self._replace(f"failed-rank{self.rank}", {"check": name, "at": time.time()})

    def _replace(self, name: str, content: dict) -> None:
        """Write ``name`` whole or not at all: the harness reads these files while this rank runs."""
        if not self.out:
            return
        path = os.path.join(self.out, name)
        with open(os.path.join(self.out, f"tmp-{name}"), "w") as f:
            json.dump(content, f)
        os.replace(os.path.join(self.out, f"tmp-{name}"), path)


def _run_one(fn: Callable, world) -> tuple[str, BaseException | None]:
    try:
        fn(world)
        return "ok", None
    except CheckSkipped as e:
        return f"{SKIPPED}{e}", None
    except Exception as e:
        return f"{type(e).__name__}: {e}\n{traceback.format_exc()}", e


def suite_key(module_name: str, check_name: str) -> str:
    """How a check of a suite world is reported: ``<worker>.<check>``."""
    return f"{module_name.rsplit('.', 1)[-1]}.{check_name}"


def _checks(modules) -> list[tuple[str, Callable]]:
    if modules is None:  # the worker script itself
        return list(_REGISTRY.get("__main__", {}).items())
    return [(suite_key(m.__name__, name), fn) for m in modules for name, fn in _REGISTRY.get(m.__name__, {}).items()]


def main(modules=None, **init_kwargs) -> None:
    """Run the checks of the calling worker script, or of every module in ``modules`` in turn (a
    suite: several workers' checks in one world, reported as ``<worker>.<check>``)."""
    import popmesh
    from popmesh.core.errors import CommTimeout, PeerFailure

    world = popmesh.init(**init_kwargs)
    report = _Report(world.rank)
    fail_fast = os.environ.get("POPMESH_TEST_FAIL_FAST") == "1"
    for name, fn in _checks(modules):
        report.write(name)
        start = time.perf_counter()
        report.outcomes[name], error = _run_one(fn, world)
        report.seconds[name] = round(time.perf_counter() - start, 4)
        if error is None:
            continue
        report.failed(name)
        if fail_fast:  # the harness takes the world down; peers may be waiting for this rank
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(60)
            os._exit(1)
        if isinstance(error, (CommTimeout, PeerFailure)):
            break
    report.write(None)
    world.finalize()
