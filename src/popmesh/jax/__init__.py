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
    DP_AXIS_NAME,
    POP_AXIS_NAME,
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
from popmesh.jax.distributed import JaxProcess, init, read_jax_env, shutdown  # noqa: E402
from popmesh.jax.fsdp import (  # noqa: E402
    PaddedPartitioned,
    gather_array_with_mean_grads,
    gather_params,
    shard_module_params,
    shard_params,
    sharded_init,
    sync_gradients,
)
from popmesh.jax.mapping import (  # noqa: E402
    get_global_ranks,
    get_process_id,
    is_dist_initialized,
    shmap_map,
    shmap_vmap,
    split_key_to_devices,
    tree_device_put,
)
from popmesh.jax.population import (  # noqa: E402
    ReplacementPlan,
    num_replaced,
    population_update,
    replace_worst,
    replacement_plan,
)
from popmesh.jax.updates import agent_gradient_update, gradient_update, loss_and_pgrad  # noqa: E402

__all__ = [
    "JaxProcess",
    "init",
    "read_jax_env",
    "shutdown",
    "DP_AXIS_NAME",
    "POP_AXIS_NAME",
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
    "gradient_update",
    "agent_gradient_update",
    "shmap_vmap",
    "shmap_map",
    "split_key_to_devices",
    "tree_device_put",
    "get_global_ranks",
    "get_process_id",
    "is_dist_initialized",
    "PaddedPartitioned",
    "shard_params",
    "gather_array_with_mean_grads",
    "gather_params",
    "shard_module_params",
    "sync_gradients",
    "sharded_init",
    "ReplacementPlan",
    "num_replaced",
    "replacement_plan",
    "replace_worst",
    "population_update",
]
