"""Worker side of world tests: register checks, run them all in one world, write results per rank."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable

_REGISTRY: dict[str, dict[str, Callable]] = {}


def check(fn: Callable) -> Callable:
    """Register ``fn(world)`` as a check of its module; it passes if it returns without raising."""
    _REGISTRY.setdefault(fn.__module__, {})[fn.__name__] = fn
    return fn


def checks_of(module) -> list[str]:
    """Names of the checks a worker module registered, in order."""
    return list(_REGISTRY.get(module.__name__, {}))


def main(**init_kwargs) -> None:
    import popmesh
    from popmesh.core.errors import CommTimeout, PeerFailure

    world = popmesh.init(**init_kwargs)
    results: dict[str, str] = {}
    for name, fn in _REGISTRY.get("__main__", {}).items():
        try:
            fn(world)
            results[name] = "ok"
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            if isinstance(e, (CommTimeout, PeerFailure)):
                break
    out = os.environ.get("POPMESH_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{world.rank}.json"), "w") as f:
            json.dump(results, f)
    world.finalize()
