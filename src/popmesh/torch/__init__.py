"""Model sync for torch modules over any popmesh engine: bucketed gradient averaging
(:class:`GradientSync`, :func:`mean_grads_`), parameter averaging and broadcasting
(:func:`mean_params_`, :func:`broadcast_params_`), all in place, and the hand-over of a run's state to
a rank that rejoined a re-formed world (:func:`hand_over`), streamed in bounded chunks from one or
several donors (:func:`stream_state_`).

Needs PyTorch (``pip install 'popmesh[torch]'``); importing ``popmesh`` alone does not import this,
and importing this imports torch only when a public name is first used.
Communication goes through popmesh's collectives, so the same code runs on gloo, MPI and a world
of one.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None:  # pragma: no cover - torch is an extra
    from popmesh.core.errors import EngineUnavailable

    raise EngineUnavailable("popmesh.torch needs PyTorch: pip install 'popmesh[torch]'")

from typing import Any

_LAZY = {
    "popmesh.torch.params": ("mean_grads_", "mean_params_", "broadcast_params_"),
    "popmesh.torch.sync": ("GradientSync", "default_cap_bytes"),
    "popmesh.torch.handover": ("hand_over", "donor_of", "broadcast_optimizer_state"),
    "popmesh.torch.stream": ("stream_state_",),
    "popmesh.torch.fingerprint": ("model_fingerprint",),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [name for names in _LAZY.values() for name in names]


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use, so that the pure planning in
    :mod:`popmesh.torch.bucketing` imports without torch."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'popmesh.torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
