"""Where gradients live during a bucketed sync: the parameters to sync and their flat buffers.

:class:`ParamSource` reads the parameters of a module (or of a tensor or list of tensors) each time
they are needed, so a changed model is noticed. :class:`FlatGrads` turns a
:class:`~popmesh.torch.bucketing.BucketPlan` into one persistent flat buffer per bucket and hands every
parameter a *view* of its slice as ``param.grad``: autograd then accumulates straight into the
bucket, and no flatten/unflatten copy happens per step.

Each buffer carries one extra element per parameter after the gradients: a has-grad flag (1 where
this rank had a gradient, 0 where it had None). The flags ride along in the bucket's own collective,
so ranks agree on which parameters have gradients without a collective of their own.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from popmesh.core.errors import ConfigError
from popmesh.core.flat import views_of
from popmesh.torch.bucketing import BucketPlan, ParamSpec

__all__ = ["ParamSource", "FlatGrads", "specs_of", "signature_of"]

Named = list[tuple[str, torch.Tensor]]


class ParamSource:
    """The parameters to sync, re-read on every call: a module's trainable parameters (those with
    ``requires_grad``), one tensor, or a fixed sequence of tensors. With ``weak`` a module or tensor
    is held by a weak reference, so a cache of syncs per module does not keep the module alive."""

    def __init__(self, obj: Any, weak: bool = False) -> None:
        self._fixed: tuple[torch.Tensor, ...] | None = None
        if isinstance(obj, (torch.nn.Module, torch.Tensor)):
            self._ref: Any = weakref.ref(obj) if weak else (lambda: obj)
            self.kind = "module" if isinstance(obj, torch.nn.Module) else "tensor"
            return
        if isinstance(obj, Iterable):
            tensors = tuple(obj)
            if all(isinstance(t, torch.Tensor) for t in tensors):
                self._fixed, self.kind = tensors, "tensors"
                return
        raise TypeError(f"expected a torch.nn.Module, a tensor or a sequence of tensors, got {type(obj).__name__}")

    def target(self) -> Any:
        """The module or tensor itself (or the tuple of tensors)."""
        if self._fixed is not None:
            return self._fixed
        obj = self._ref()
        if obj is None:
            raise ConfigError(f"the {self.kind} this sync was built for has been garbage collected: "
                              "keep a reference to it for as long as you sync it")
        return obj

    def current(self) -> Named:
        """``(name, parameter)`` pairs in registration order, trainable ones only."""
        obj = self.target()
        if self.kind == "module":
            return [(name, p) for name, p in obj.named_parameters() if p.requires_grad]
        tensors = (obj,) if self.kind == "tensor" else obj
        return [(str(i), t) for i, t in enumerate(tensors) if t.requires_grad]


def signature_of(params: Named) -> tuple[Any, ...]:
    """Cheap identity of a parameter list: names, objects, shapes, dtypes, devices."""
    return tuple((name, id(p), p.shape, p.dtype, p.device) for name, p in params)


def specs_of(params: Named) -> list[ParamSpec]:
    """The planner's view of the parameters."""
    return [ParamSpec(name, p.numel(), str(p.dtype), str(p.device)) for name, p in params]


class FlatGrads:
    """One flat buffer per bucket of ``plan``, gradient views into it, and the has-grad flags.

    Contract: the parameters are exactly the ones ``plan`` was made from, in the same order.
    """

    def __init__(self, plan: BucketPlan, params: Named, memory: list[torch.Tensor | None] | None = None) -> None:
        """``memory``: per bucket, a zeroed tensor to use as its buffer (None: a new one)."""
        self.plan = plan
        self.params = [p for _, p in params]
        self.names = [name for name, _ in params]
        self.buffers: list[torch.Tensor] = []
        self.grad_parts: list[torch.Tensor] = []
        self.flags: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        self.bucket_of = [0] * len(self.params)
        for b, bucket in enumerate(plan.buckets):
            like = self.params[bucket.indices[0]]
            given = memory[b] if memory is not None else None
            buf = given if given is not None else torch.zeros(bucket.numel + len(bucket.indices), dtype=like.dtype,
                                                                  device=like.device)
            self.buffers.append(buf)
            self.grad_parts.append(buf[:bucket.numel])
            self.flags.append(buf[bucket.numel:])
            shapes = [tuple(self.params[i].shape) for i in bucket.indices]
            for i, view in zip(bucket.indices, views_of(buf, shapes, bucket.offsets)):
                self.views[i] = view
                self.bucket_of[i] = b

    def rebind(self, params: Named) -> None:
        """Point at new parameter objects with the same specs (the buffers are kept)."""
        self.params = [p for _, p in params]
        self.names = [name for name, _ in params]

    def attach(self, i: int) -> bool:
        """Make parameter ``i``'s gradient the view of its slice, copying a gradient that lives
        elsewhere (``zero_grad(set_to_none=True)`` lets autograd allocate a fresh one). Returns
        whether the parameter has a gradient on this rank."""
        p, view = self.params[i], self.views[i]
        grad = p.grad
        if grad is None:
            return False
        if grad is not view:
            if grad.is_sparse:
                raise ConfigError(f"parameter {self.names[i]!r} has a sparse gradient: GradientSync "
                                  "averages dense gradients only (use popmesh.all_reduce on it)")
            view.copy_(grad)
            p.grad = view
        return True

    def prepare(self, b: int) -> bool:
        """Fill bucket ``b`` for reduction: gradients attached, missing ones zeroed, flags set.
        Returns whether some parameter of the bucket has no gradient on this rank."""
        bucket = self.plan.buckets[b]
        flags = self.flags[b]
        present = [self.attach(i) for i in bucket.indices]
        if all(present):
            flags.fill_(1)
            return False
        for i, has in zip(bucket.indices, present):
            if not has:
                self.views[i].zero_()
        flags.copy_(torch.tensor(present, dtype=flags.dtype))
        return True

    def materialise(self, b: int) -> None:
        """After the reduction: every parameter that had a gradient on some rank gets the averaged
        view as its gradient; parameters no rank had a gradient for keep ``grad = None``."""
        bucket = self.plan.buckets[b]
        seen = (self.flags[b] > 0).tolist()
        for i, anywhere in zip(bucket.indices, seen):
            p = self.params[i]
            if anywhere and p.grad is None:
                p.grad = self.views[i]
