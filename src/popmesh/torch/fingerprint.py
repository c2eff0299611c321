"""A short text that names a model's architecture: what an elastic world's ranks compare before a
newcomer joins (``popmesh.init(fingerprint=model_fingerprint(model))``), so that a process built for
another model is refused before it joins instead of failing the hand-over of the state on every rank."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["model_fingerprint"]


def model_fingerprint(module: torch.nn.Module) -> str:
    """The module's class, its tensor count and element count, and a digest of every parameter's and
    buffer's name, shape and dtype, in the module's order: equal for two builds of one architecture,
    different where a name, a shape or a dtype differs. Reads no values."""
    digest = hashlib.sha256()
    tensors = elements = 0
    for kind, named in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, tensor in named:
            digest.update(f"{kind} {name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
            tensors += 1
            elements += tensor.numel()
    return f"{type(module).__name__}: {tensors} tensors, {elements:,} elements, {digest.hexdigest()[:12]}"
