"""What the MPI engine moves: host memory only. A tensor on a GPU is refused with a clear error.

The MPICH wheel from PyPI (popmesh's ``mpich`` extra) is not CUDA-aware: ``MPI_Iallreduce`` and
``MPI_Win_allocate`` take host pointers. popmesh does not copy a CUDA tensor through host memory
behind the caller's back either: every collective that receives one (``all_reduce_``,
``all_reduce_start``, ``all_gather``, ``broadcast_``, ``gather``, ``reduce_scatter``), a one-sided
window's ``publish``, and the mechanisms that expose a model in windows (``OneSidedAveraging``,
through ``MpiEngine.require_host``; spawn_policy's ``...mpi4pyGeneral``/``...mpi4pyFast``, whose
windows are MPI's on either engine) raise :class:`~popmesh.core.errors.ConfigError` naming the way out:
``.cpu()``, or the torch engine, whose nccl backend moves CUDA tensors. The check runs on the rank
that holds the tensor before MPI is handed the buffer (the mechanisms: before their windows are
made), so MPI never sees a device pointer.

Point-to-point messages are another matter: the wire format frames every payload into host bytes
on every engine (a tensor keeps its dtype, shape and device type, see :mod:`popmesh.wire`), so the
MPI transport only ever sees bytes and numpy arrays. None of this was run on a GPU: the refusal is
tested with a stand-in object, and CUDA tensors on the other paths are untested on GPU.
"""

from __future__ import annotations

from typing import Any

from popmesh.core.errors import ConfigError

__all__ = ["CUDA_REFUSED", "require_host"]

CUDA_REFUSED = (
    "the MPI engine cannot move CUDA tensors (MPICH from PyPI is not CUDA-aware): move it to the CPU "
    "with .cpu(), or use the torch engine, whose nccl backend moves CUDA tensors (popmesh launch "
    "--engine torch)"
)


def require_host(value: Any, what: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` lives in host memory, which MPI can move.

    ``value`` is an array or tensor (anything else passes: numpy arrays have no ``is_cuda``); a
    CUDA tensor gets :data:`CUDA_REFUSED`, a tensor on another device (mps, xpu, meta) the same
    advice in general terms. ``what`` names the call in the message. Pure: no MPI, no torch import.
    """
    if getattr(value, "is_cuda", False):
        raise ConfigError(f"{what}: {CUDA_REFUSED}")
    if getattr(value, "is_cpu", True) is False:
        device = getattr(value, "device", "another device")
        raise ConfigError(f"{what}: the MPI engine moves host memory only, and this tensor is on {device}: "
                          "move it to the CPU with .cpu(), or use the torch engine (popmesh launch --engine torch)")
