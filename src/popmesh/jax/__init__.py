"""JAX layer: axis-optional collectives, gradient updates, shard_map population helpers, FSDP,
in-graph population replacement.

Importing ``popmesh`` never imports JAX; importing ``popmesh.jax`` needs the ``popmesh[jax]`` extra
(jax, flax, optax). Everything here is traced code meant to run inside ``jax.shard_map`` (or on a
single device with ``axis_name=None``); see ``docs/jax.md``.
"""

from __future__ import annotations

import importlib.util

from popmesh.core.errors import EngineUnavailable

_missing = [name for name in ("jax", "flax", "optax") if importlib.util.find_spec(name) is None]
if _missing:
    raise EngineUnavailable(
        f"popmesh.jax needs {', '.join(_missing)}: install the extra with `pip install popmesh[jax]`"
    )

from popmesh.jax.axes import (  # noqa: E402
    DATA_AXIS,
    POPULATION_AXIS,
    AxisName,
    UnboundAxisError,
    all_gather,
    as_varying,
    axis_size,
    pmax,
    pmean,
    pmin,
    psum,
    require_bound,
    varying_axes,
)
from popmesh.jax.distributed import JaxProcess, init, is_initialized, read_jax_env, shutdown  # noqa: E402
from popmesh.jax.fsdp import (  # noqa: E402
    PaddedPartitioned,
    gather_tree,
    gather_with_mean_grads,
    mean_grads,
    shard_module,
    shard_tree,
    sharded_init,
)
from popmesh.jax.mapping import device_ranks, map_per_device, split_key_per_device, vmap_per_device  # noqa: E402
from popmesh.jax.population import (  # noqa: E402
    ReplacementPlan,
    num_replaced,
    population_update,
    replace_worst,
    replacement_plan,
)
from popmesh.jax.updates import (  # noqa: E402
    attach_params,
    detach_params,
    loss_and_pgrad,
    make_agent_update,
    make_update,
)

__all__ = [
    "JaxProcess",
    "init",
    "is_initialized",
    "read_jax_env",
    "shutdown",
    "DATA_AXIS",
    "POPULATION_AXIS",
    "AxisName",
    "UnboundAxisError",
    "pmean",
    "psum",
    "pmin",
    "pmax",
    "all_gather",
    "axis_size",
    "require_bound",
    "varying_axes",
    "as_varying",
    "loss_and_pgrad",
    "make_update",
    "make_agent_update",
    "attach_params",
    "detach_params",
    "vmap_per_device",
    "map_per_device",
    "split_key_per_device",
    "device_ranks",
    "PaddedPartitioned",
    "shard_tree",
    "gather_tree",
    "gather_with_mean_grads",
    "shard_module",
    "mean_grads",
    "sharded_init",
    "ReplacementPlan",
    "num_replaced",
    "replacement_plan",
    "replace_worst",
    "population_update",
]
