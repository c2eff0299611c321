"""``omnisafe.utils.distributed`` (OmniSafe) over :mod:`popmesh.observe.stats`, :mod:`popmesh.torch` and
:mod:`popmesh.launch`.

Same names, parameters, order, defaults and return values as the original. The world is popmesh's
current world: a world of one when nothing was launched, and inside a launched world (``fork``,
``popmesh launch``, torchrun, mpiexec) the world is initialised on first use, as OmniSafe's children
initialised their process group. Every function runs on the torch and the MPI engine alike.

Map: ``dist_op``/``dist_sum``/``dist_avg``/``dist_max``/``dist_min`` → ``reduce_value``;
``dist_statistics_scalar`` → ``mean_std``; ``avg_tensor`` → ``popmesh.all_reduce_(x, "avg")``;
``avg_grads`` → ``popmesh.torch.mean_grads_``; ``avg_params`` → ``mean_params_``; ``sync_params``
→ ``broadcast_params_``; ``setup_distributed`` is the facade's own.

Where popmesh deliberately behaves differently from OmniSafe:

* "distributed or not" comes from the launcher's variables, not from ``MASTER_ADDR`` alone, so a
  stray ``MASTER_ADDR`` gives a world of one instead of a crash;
* ``dist_op`` / ``dist_sum`` / ``dist_avg`` / ``dist_max`` / ``dist_min`` keep the input's dtype
  and device (OmniSafe converted to float32) and never overwrite the caller's tensor (OmniSafe's
  float32 inputs received the reduced value in place); ``dist_op`` also accepts AVG and PROD;
* ``dist_statistics_scalar`` returns the true global minimum and maximum as scalars (OmniSafe's
  were element-wise across ranks, so their "min"/"max" needed equal lengths and equalled the mean
  in a single process), and accepts different lengths per rank;
* ``avg_tensor`` accepts 0-d tensors on every world size (OmniSafe rejected them when distributed);
* ``avg_grads`` is bucketed, and a gradient that is None on some ranks counts as zeros instead of
  hanging; ``sync_params`` also copies buffers (normaliser statistics);
* ``fork`` relaunches ``python -m module`` as well as scripts and raises if a rank fails;
  ``bind_to_core`` and ``use_number_of_threads`` are accepted and have no effect (as in OmniSafe's
  torchrun version); ``device`` is accepted, each rank picks its GPU from ``LOCAL_RANK``;
* ``setup_distributed`` shares the node's CPU cores (this process's affinity) among its local
  ranks, instead of dividing the current thread count by the world size; it prints once.

OmniSafe's module also re-exported ``reduce``, ``all_reduce``, ``gather``, ``all_gather``,
``broadcast`` and ``scatter`` from ``torch.distributed``; the seed document does not list them, so
the facade does not either: use ``popmesh``'s collectives.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

import popmesh.observe.stats as _stats
import popmesh.torch as _pt
from popmesh.comm.collectives import all_reduce_ as _all_reduce_
from popmesh.comm.world import World
from popmesh.comm.world import current_world as _current_world
from popmesh.comm.world import init as _init
from popmesh.core.arrays import is_torch
from popmesh.core.errors import ConfigError
from popmesh.launch import fork as _fork
from popmesh.launch import in_launched_world
from popmesh.launch import launch as _launch

__all__ = [
    "setup_distributed",
    "get_rank",
    "is_master",
    "world_size",
    "fork",
    "avg_tensor",
    "avg_grads",
    "sync_params",
    "avg_params",
    "dist_avg",
    "dist_sum",
    "dist_max",
    "dist_min",
    "dist_op",
    "dist_statistics_scalar",
]


def _world() -> World:
    """The current world; inside a launched world that has not called ``popmesh.init`` yet, init it."""
    try:
        return _current_world()
    except ConfigError:
        return _init()


_ANNOUNCED = False


def setup_distributed() -> None:
    """Avoid slowdowns caused by each separate process's PyTorch, using more than its fair share of
    CPU resources: torch uses ``max(1, cores // local ranks)`` threads.

    cores counts this process's CPU affinity; the decision is printed once, on the main rank.
    """
    global _ANNOUNCED
    world = _world()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, world.local_size))
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(threads)
    if world.is_main and not _ANNOUNCED:
        print(f"popmesh: {world.local_size} local rank(s) share {cores} core(s): {threads} torch thread(s) per rank",
              flush=True)
    _ANNOUNCED = True


def get_rank() -> int:
    """Get rank of calling process (0 in a world of one)."""
    return _world().rank


def is_master() -> bool:
    """Test whether the process is the root process."""
    return _world().is_main


def world_size() -> int:
    """Count active processes (1 when nothing was launched)."""
    return _world().size


def fork(parallel: int, bind_to_core: bool = False, use_number_of_threads: bool = False, device: str = "cpu",
         manual_args: list[str] | None = None) -> bool:
    """The entrance of multi-processing: relaunch this program on ``parallel`` ranks.

    True in the parent once every rank succeeded (``if fork(n): sys.exit()``); False inside the
    ranks and for ``parallel == 1``. ``manual_args`` (``[script, *args]``) replaces the relaunched
    command line. Raises ``popmesh.launch.LaunchFailed`` if a rank fails.
    """
    if manual_args is None:
        return _fork(parallel, engine="torch")
    if parallel < 1:
        raise ConfigError(f"fork(parallel) needs parallel >= 1, got {parallel}")
    if in_launched_world() or parallel == 1:
        return False
    _launch(manual_args[0], list(manual_args[1:]), nproc=parallel, engine="torch").check()
    return True


def avg_tensor(value: Any) -> None:
    """Average a torch tensor over processes, in place (0-d tensors included).

    Every rank calls it with a floating tensor of the same shape; rank r's ``value`` becomes the
    mean over all ranks.
    """
    _world()
    if not (is_torch(value) or isinstance(value, np.ndarray)):
        raise TypeError(f"avg_tensor writes in place: pass a tensor, not {type(value).__name__} "
                        "(dist_avg returns a new value)")
    if _stats.is_integral(value):
        raise ConfigError(f"avg_tensor needs a floating dtype to hold an average in place, got {value.dtype}: "
                          "use dist_avg, which returns a float")
    _all_reduce_(value, "avg")


def avg_grads(module: Any) -> None:
    """Average contents of gradient buffers across processes, in place (a module or a tensor)."""
    _world()
    _pt.mean_grads_(module)


def sync_params(module: Any) -> None:
    """Sync all parameters (and buffers) of module across all processes: rank 0's are copied."""
    _world()
    _pt.broadcast_params_(module)


def avg_params(module: Any) -> None:
    """Average contents of all parameters across processes, in place."""
    _world()
    _pt.mean_params_(module)


def dist_avg(value: Any) -> Any:
    """Average a tensor over distributed processes (element-wise): a new tensor."""
    _world()
    return _stats.reduce_value(value, "avg")


def dist_sum(value: Any) -> Any:
    """Sum a tensor over distributed processes (element-wise): a new tensor."""
    _world()
    return _stats.reduce_value(value, "sum")


def dist_max(value: Any) -> Any:
    """Determine global maximum of tensor over distributed processes (element-wise)."""
    _world()
    return _stats.reduce_value(value, "max")


def dist_min(value: Any) -> Any:
    """Determine global minimum of tensor over distributed processes (element-wise)."""
    _world()
    return _stats.reduce_value(value, "min")


def dist_op(value: Any, operation: Any) -> Any:
    """Multi-processing operation: ``operation`` (``ReduceOp.SUM``/``MAX``/``MIN``, also AVG/PROD,
    torch's or popmesh's enum or a name) element-wise across processes; a new tensor."""
    _world()
    return _stats.reduce_value(value, operation)


def dist_statistics_scalar(value: Any, with_min_and_max: bool = False) -> tuple[Any, ...]:
    """Get mean/std and optional min/max of scalar x across processes.

    ``(mean, std)`` or ``(mean, std, min, max)`` over every element on every rank (population std);
    ranks may hold different numbers of elements. Fixed: min/max are global scalars.
    """
    _world()
    return _stats.mean_std(value, with_min_and_max)
