"""Moving between numpy arrays and torch tensors without copies where the memory allows.

Imports torch only when a torch tensor is actually involved. bfloat16 travels as its raw 16-bit
pattern, so no value is ever cast on the way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["numpy_to_torch", "torch_to_numpy", "torch_bytes", "numpy_bytes", "is_bfloat16_numpy"]


def is_bfloat16_numpy(a: np.ndarray) -> bool:
    """numpy has no native bfloat16; ml_dtypes (installed with jax) adds one named ``bfloat16``."""
    return a.dtype.name == "bfloat16"


def numpy_to_torch(a: np.ndarray) -> Any:
    """A tensor sharing ``a``'s memory (``a`` must be contiguous and writeable)."""
    import torch

    if is_bfloat16_numpy(a):
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_to_numpy(t: Any, like: np.ndarray | None = None) -> np.ndarray:
    """A numpy view of a CPU tensor; bfloat16 comes back as ``like``'s dtype if given, else uint16."""
    import torch

    if t.dtype == torch.bfloat16:
        raw = t.view(torch.uint16).numpy() if hasattr(torch, "uint16") else t.view(torch.int16).numpy()
        return raw.view(like.dtype) if like is not None else raw.view(np.uint16)
    return t.numpy()


def torch_bytes(t: Any) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a uint8 numpy view."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def numpy_bytes(a: np.ndarray) -> np.ndarray:
    """The raw bytes of a contiguous array as a uint8 view."""
    return a.reshape(-1).view(np.uint8)
