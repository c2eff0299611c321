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
  float32 inputs received the reduced value in place); ``dist_op`` also accepts AVG and PROD.
  When the ranks' values differ in dtype or in being a scalar (float32 here, float64 there), they
  are reduced as OmniSafe did, as float32 tensors (scalars as one-element ones) with a float32
  result on every rank; so are ``avg_tensor``'s, ``avg_grads``' and ``avg_params``' tensors, then
  written back in their own dtype. (popmesh's own functions raise ``CollectiveMismatch`` there.)
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
from popmesh.core.errors import CollectiveMismatch, ConfigError
from popmesh.core.ops import ReduceOp
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
    try:
        _all_reduce_(value, "avg")
    except CollectiveMismatch:  # the ranks' dtypes differ: OmniSafe's float32 average, written back
        _write_back(value, _as_omnisafe(value, ReduceOp.AVG))


def avg_grads(module: Any) -> None:
    """Average contents of gradient buffers across processes, in place (a module or a tensor)."""
    _world()
    try:
        _pt.mean_grads_(module)
    except CollectiveMismatch:  # the ranks' dtypes differ: OmniSafe's per-tensor float32 average
        for grad in _grads_of(module):
            _write_back(grad, _as_omnisafe(grad, ReduceOp.AVG))


def sync_params(module: Any) -> None:
    """Sync all parameters (and buffers) of module across all processes: rank 0's are copied."""
    _world()
    _pt.broadcast_params_(module)


def avg_params(module: Any) -> None:
    """Average contents of all parameters across processes, in place."""
    _world()
    try:
        _pt.mean_params_(module)
    except CollectiveMismatch:  # the ranks' dtypes differ: OmniSafe's per-tensor float32 average
        for param in module.parameters():
            _write_back(param.data, _as_omnisafe(param.data, ReduceOp.AVG))


def dist_avg(value: Any) -> Any:
    """Average a tensor over distributed processes (element-wise): a new tensor."""
    return _reduce(value, "avg")


def dist_sum(value: Any) -> Any:
    """Sum a tensor over distributed processes (element-wise): a new tensor."""
    return _reduce(value, "sum")


def dist_max(value: Any) -> Any:
    """Determine global maximum of tensor over distributed processes (element-wise)."""
    return _reduce(value, "max")


def dist_min(value: Any) -> Any:
    """Determine global minimum of tensor over distributed processes (element-wise)."""
    return _reduce(value, "min")


def dist_op(value: Any, operation: Any) -> Any:
    """Multi-processing operation: ``operation`` (``ReduceOp.SUM``/``MAX``/``MIN``, also AVG/PROD,
    torch's or popmesh's enum or a name) element-wise across processes; a new tensor."""
    return _reduce(value, operation)


def dist_statistics_scalar(value: Any, with_min_and_max: bool = False) -> tuple[Any, ...]:
    """Get mean/std and optional min/max of scalar x across processes.

    ``(mean, std)`` or ``(mean, std, min, max)`` over every element on every rank (population std);
    ranks may hold different numbers of elements. Fixed: min/max are global scalars.
    """
    _world()
    return _stats.mean_std(value, with_min_and_max)


def _reduce(value: Any, operation: Any) -> Any:
    """``reduce_value``, or OmniSafe's float32 reduction when the ranks' dtypes differ."""
    _world()
    try:
        return _stats.reduce_value(value, operation)
    except CollectiveMismatch:  # every rank raised it, and the group is clean: all redo it as OmniSafe did
        return _as_omnisafe(value, ReduceOp.parse(operation))


def _as_omnisafe(value: Any, op: ReduceOp) -> Any:
    """OmniSafe's ``dist_op``: a scalar as a one-element list, everything as a new float32 tensor,
    reduced across the world (AVG: the sum divided by the world's size), a scalar returned as 0-d.
    Raises CollectiveMismatch if the ranks' shapes differ even so."""
    import torch

    scalar = bool(np.isscalar(value))
    tensor = torch.as_tensor([value] if scalar else value, dtype=torch.float32)
    if tensor is value or (is_torch(value) and tensor.data_ptr() == value.data_ptr()):
        tensor = tensor.clone()  # OmniSafe reduced a float32 caller's tensor in place; the facade never does
    summed = op is ReduceOp.AVG
    _all_reduce_(tensor, ReduceOp.SUM if summed else op)
    if summed:
        tensor /= _world().size
    return tensor[0] if scalar else tensor


def _write_back(target: Any, result: Any) -> None:
    """Copy ``result`` into ``target`` (a tensor or a numpy array) in ``target``'s dtype."""
    if isinstance(target, np.ndarray):
        np.copyto(target, result.numpy(), casting="unsafe")
    else:
        target.copy_(result)


def _grads_of(module: Any) -> list[Any]:
    """The gradients ``avg_grads`` averages: of a module's parameters, a tensor, or a sequence of tensors."""
    tensors = list(module.parameters()) if hasattr(module, "parameters") else (
        [module] if is_torch(module) else list(module))
    return [t.grad for t in tensors if t.grad is not None]
