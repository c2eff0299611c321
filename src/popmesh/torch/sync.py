"""Bucketed gradient averaging for torch modules: one collective per bucket, overlapped with backward.

:class:`GradientSync` plans buckets once (per dtype and device, ``popmesh.torch.bucketing``), keeps every
gradient as a view into a persistent flat buffer (no flatten/unflatten copy per step) and averages
each bucket with one non-blocking all-reduce. With ``overlap=True`` a bucket's reduction starts
during backward, as soon as all its gradients are ready; :meth:`GradientSync.wait` (or calling the
object) finishes. Buckets are always started in plan order, so every rank issues the same
collectives in the same order whatever order its gradients arrive in.

Cross-rank contract: every rank of ``group`` builds its GradientSync over the same model structure
(names, shapes, dtypes, in the same order) and calls :meth:`~GradientSync.wait` once per step.
Ranks may differ in *which* parameters received a gradient: a missing gradient counts as zeros and
every rank ends with the average (divided by the group's size); a parameter that no rank has a
gradient for keeps ``grad = None``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from popmesh.comm.agreement import agree
from popmesh.comm.asynchronous import AsyncHandle, all_reduce_async_
from popmesh.comm.world import Comm, resolve_group
from popmesh.core import trace
from popmesh.core.errors import ConfigError
from popmesh.core.ops import ReduceOp
from popmesh.core.timeouts import check_timeout
from popmesh.torch.bucketing import DEFAULT_CAP_BYTES, BucketPlan, plan_buckets, plan_differs
from popmesh.torch.layout import FlatGrads, Named, ParamSource, signature_of, specs_of

__all__ = ["GradientSync", "default_cap_bytes"]

_LENDABLE = {"float32": 4, "float64": 8}  # bucket dtypes an engine may reduce in shared memory


def default_cap_bytes(group: Comm | None = None, device: str = "cpu") -> int:
    """The bucket cap GradientSync uses for parameters on ``device`` over ``group``'s engine: the
    engine's measured CPU cap (:class:`~popmesh.engines.base.Tuning`), else DDP's 25 MiB."""
    if str(device).split(":", 1)[0] != "cpu":
        return DEFAULT_CAP_BYTES
    return resolve_group(group).world.engine.tuning.cpu_bucket_cap_bytes or DEFAULT_CAP_BYTES


class GradientSync:
    """Average the gradients of ``module`` across ``group`` with one collective per bucket.

    ``module``: an ``nn.Module`` (its parameters with ``requires_grad``), a tensor, or a sequence
    of tensors. ``cap_bytes``: bucket size; None picks a tuned default (:func:`default_cap_bytes`:
    for CPU parameters 16 MiB on gloo and 4 MiB on MPI, else 25 MiB). ``overlap``: start each
    bucket's reduction during backward (on engines that progress only inside their own calls, MPI,
    backward only moves the gradients into the buckets and ``wait()`` reduces them: ``Tuning``).
    On MPI with every member on one node the buckets live in a shared-memory window the engine
    lends, and are reduced there in place (``popmesh.engines.mpi.shared_reduce``).
    ``weak``: hold the module by a weak reference (for caches keyed by the module).

    Use::

        sync = GradientSync(model)
        loss.backward()
        sync()              # every param.grad now holds the group average
        optimizer.step()

    ``optimizer.zero_grad()`` works with either ``set_to_none``: views are kept (and zeroed) with
    ``False``; with ``True`` (torch's default) autograd allocates fresh gradients, which are copied
    into the buckets once and replaced by the views again. For gradient accumulation over several
    backward passes, run all but the last inside ``with sync.no_sync():``.
    """

    def __init__(self, module: Any, group: Comm | None = None, cap_bytes: int | None = None,
                 overlap: bool = True, *, timeout: float | None = None, weak: bool = False) -> None:
        self._comm = resolve_group(group)
        self._comm.require_member("GradientSync")
        self._source = ParamSource(module, weak)
        if cap_bytes is not None and (isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int)
                                      or cap_bytes <= 0):
            raise ConfigError(f"cap_bytes must be a positive int or None (engine default), got {cap_bytes!r}")
        self._cap = cap_bytes if cap_bytes is not None else self._default_cap()
        self._in_flight = self._comm.world.engine.tuning.max_in_flight
        self._overlap = bool(overlap)
        self._reduce_in_backward = self._comm.world.engine.tuning.reduce_in_backward
        self._timeout = None if timeout is None else check_timeout(timeout, what="GradientSync")
        self._grads: FlatGrads | None = None
        self._signature: tuple[Any, ...] = ()
        self._hooks: list[Any] = []
        self._paused = 0
        self._rebuild(self._source.current())

    # ---- public -----------------------------------------------------------------------------
    @property
    def plan(self) -> BucketPlan:
        """The bucket layout in use."""
        return self._layout().plan

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat gradients, one tensor per bucket of :attr:`plan`; every ``param.grad`` is a view
        into one of them (after its first sync), so e.g. a gradient norm can be taken over a few
        large tensors instead of hundreds of small ones."""
        return list(self._layout().grad_parts)

    @property
    def group(self) -> Comm:
        return self._comm

    @property
    def cap_bytes(self) -> int:
        return self._cap

    @property
    def overlap(self) -> bool:
        return self._overlap

    def __call__(self, timeout: float | None = None) -> None:
        """Same as :meth:`wait`."""
        self.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Finish averaging: start the buckets backward did not start, wait for all, in order.

        Re-plans first if the parameters changed (added, removed, reshaped, new dtype or device).
        Every rank of the group must call this once per step.
        """
        seconds = self._timeout if timeout is None else check_timeout(timeout, what="GradientSync.wait")
        try:
            params = self._source.current()
            changed = signature_of(params) != self._signature
            if changed and self._next:
                self._finish_all(seconds)
                raise ConfigError(
                    "GradientSync: the parameters changed between backward and sync, after reductions had "
                    "started: change the model before forward (the next sync re-plans)")
            if changed:
                self._rebuild(params)
            self._finish_all(seconds)
        finally:
            self._reset_pass()

    @contextmanager
    def no_sync(self) -> Iterator[GradientSync]:
        """Backward passes inside only accumulate (no reduction starts): for gradient accumulation."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    def close(self) -> None:
        """Remove the backward hooks. The gradients stay valid tensors."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __repr__(self) -> str:
        plan = self._layout().plan
        return (f"GradientSync({len(plan.specs)} params, {len(plan.buckets)} buckets, cap={self._cap} B, "
                f"overlap={self._overlap}, group={list(self._comm.ranks)})")

    # ---- one step ---------------------------------------------------------------------------
    def _default_cap(self) -> int:
        kinds = {p.device.type for _, p in self._source.current()}
        return default_cap_bytes(self._comm, next((k for k in sorted(kinds) if k != "cpu"), "cpu"))

    def _layout(self) -> FlatGrads:
        if self._grads is None:
            raise ConfigError("GradientSync is not built: construct it again")
        return self._grads

    def _reset_pass(self) -> None:
        plan = self._layout().plan
        self._handles: list[AsyncHandle | None] = [None] * len(plan.buckets)
        self._missing = [False] * len(plan.buckets)
        self._started = [0] * len(plan.buckets)  # perf_counter_ns at each bucket's start, while tracing
        self._left = [len(b.indices) for b in plan.buckets]
        self._ready = [False] * len(plan.specs)
        self._next = 0
        self._done = 0
        self._armed = False
        self._stale = False

    def _launch(self, b: int, timeout: float | None) -> None:
        """Start bucket ``b``'s reduction (after the oldest one, if the engine allows only so many)."""
        if self._in_flight and b - self._done >= self._in_flight:
            self._complete(timeout)
        grads = self._layout()
        self._missing[b] = grads.prepare(b)
        if trace.ACTIVE is not None:
            self._started[b] = time.perf_counter_ns()
        self._handles[b] = all_reduce_async_(grads.buffers[b], ReduceOp.AVG, group=self._comm,
                                             timeout=self._timeout)
        self._next = b + 1

    def _complete(self, timeout: float | None) -> None:
        """Wait for the oldest unfinished bucket and give its parameters their averaged gradients."""
        b = self._done
        handle = self._handles[b]
        assert handle is not None, "buckets complete in the order they started"
        handle.wait(timeout)
        if self._missing[b]:
            self._layout().materialise(b)
        self._done = b + 1
        if trace.ACTIVE is not None and self._started[b]:
            buf = self._layout().buffers[b]
            trace.ACTIVE.add("grad_sync.bucket", "grad_sync", self._started[b], time.perf_counter_ns(),
                             {"bucket": b, "bytes": buf.numel() * buf.element_size()})

    def _finish_all(self, timeout: float | None) -> None:
        for b in range(self._next, len(self._handles)):
            self._launch(b, timeout)
        while self._done < len(self._handles):
            self._complete(timeout)

    def _on_grad(self, i: int) -> None:
        """Backward hook: parameter ``i``'s gradient is complete; start every bucket now ready."""
        if self._paused:
            return
        if not self._armed:  # first hook of this pass: a changed model waits for wait() to re-plan
            self._armed = True
            self._stale = signature_of(self._source.current()) != self._signature
        if self._stale:
            return
        grads = self._layout()
        b = grads.bucket_of[i]
        if self._ready[i]:  # its hook fires once per backward: this is a second pass before wait()
            raise ConfigError(
                f"GradientSync: a second backward pass reached {grads.names[i]!r} before sync(): call sync() "
                "after each backward, or run accumulation passes in sync.no_sync()")
        self._ready[i] = True
        grads.attach(i)
        self._left[b] -= 1
        while self._reduce_in_backward and self._next < len(self._left) and self._left[self._next] == 0:
            self._launch(self._next, self._timeout)

    # ---- (re)planning -------------------------------------------------------------------------
    def _rebuild(self, params: Named) -> None:
        specs = specs_of(params)
        if self._grads is not None and not plan_differs(self._grads.plan, specs):
            self._grads.rebind(params)
        else:
            plan = plan_buckets(specs, cap_bytes=self._cap, order="reverse")
            if self._comm.check and self._comm.size > 1:
                self._agree(plan)
            self._grads = FlatGrads(plan, params, self._lent_buffers(plan))
        self._signature = signature_of(params)
        self._install_hooks()
        for i in range(len(params)):
            self._grads.attach(i)
        self._reset_pass()

    def _lent_buffers(self, plan: BucketPlan) -> list[torch.Tensor | None] | None:
        """The buckets' buffers in shared memory the engine lends, where it does (MPI, every member on
        one node: reduced in place there, without MPI's copies), else None. Every member decides
        alike: the plan is the same and the engine and group are."""
        lend = getattr(self._comm.world.engine, "lend_shared", None)
        if lend is None or self._comm.size == 1 or not self._comm.is_member:
            return None
        sizes = [(b.numel + len(b.indices)) * _LENDABLE[b.dtype] if b.device == "cpu" and b.dtype in _LENDABLE
                 else 0 for b in plan.buckets]
        if not any(sizes):
            return None
        seconds = self._comm.timeout if self._timeout is None else self._timeout
        memory = lend(self._comm.handle, sizes, seconds)
        if memory is None:
            return None
        return [torch.from_numpy(m).view(getattr(torch, b.dtype)).zero_() if m.size else None
                for b, m in zip(plan.buckets, memory)]

    def _agree(self, plan: BucketPlan) -> None:
        numel = sum(s.numel for s in plan.specs)
        kinds = sorted({f"{b.dtype}@{b.device.split(':', 1)[0]}" for b in plan.buckets})
        text = (f"layout {plan.fingerprint()}: {len(plan.specs)} params, {numel} elements, "
                f"{len(plan.buckets)} buckets of {','.join(kinds) or 'nothing'}, cap {plan.cap_bytes} B")
        seconds = self._comm.timeout if self._timeout is None else self._timeout
        agree(self._comm, text, "GradientSync (every rank must sync the same model structure)", seconds)

    def _install_hooks(self) -> None:
        self.close()
        if not self._overlap:
            return
        ref = weakref.ref(self)
        for i, p in enumerate(self._layout().params):
            self._hooks.append(p.register_post_accumulate_grad_hook(_hook(ref, i)))  # type: ignore[no-untyped-call]  # torch: this Tensor method is unannotated


def _hook(ref: weakref.ref[GradientSync], i: int) -> Callable[[torch.Tensor], None]:
    """A hook that does not keep the GradientSync alive (the parameters outlive it)."""

    def on_grad(_: torch.Tensor) -> None:
        sync = ref()
        if sync is not None:
            sync._on_grad(i)

    return on_grad
