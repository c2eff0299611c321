"""Model sync for torch modules over any popmesh engine: bucketed gradient averaging
(:class:`GradientSync`, :func:`avg_grads`), parameter averaging and broadcasting
(:func:`avg_params`, :func:`sync_params`), and torchgfn's names for them.

Needs PyTorch (``pip install 'popmesh[torch]'``); importing ``popmesh`` alone does not import this.
Communication goes through popmesh's collectives, so the same code runs on gloo, MPI and a world
of one.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None:  # pragma: no cover - torch is an extra
    from ..errors import EngineUnavailable

    raise EngineUnavailable("popmesh.torch needs PyTorch: pip install 'popmesh[torch]'")

from .params import average_gradients, average_models, avg_grads, avg_params, sync_params  # noqa: E402
from .sync import CPU_CAP_BYTES, IN_FLIGHT, GradientSync, default_cap_bytes  # noqa: E402

__all__ = [
    "GradientSync",
    "avg_grads",
    "sync_params",
    "avg_params",
    "average_gradients",
    "average_models",
    "default_cap_bytes",
    "CPU_CAP_BYTES",
    "IN_FLIGHT",
]
