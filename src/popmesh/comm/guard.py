"""The always-on check of sized collectives: a guard all-reduce beside (or before) the payload.

See :mod:`popmesh.comm.signature` for why it is sound. A call whose signature is the group's
prediction pays the guard concurrently with its payload; a call that is not (the first of a kind,
a change of pattern, a mismatch) pays it as one latency round first. Either way a mismatch raises
:class:`CollectiveMismatch` on every rank, listing each rank's call where every rank is still at
this call, and no engine ever pairs payloads of different forms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from popmesh.comm.agreement import agree
from popmesh.comm.signature import (
    Form,
    History,
    Verdict,
    digest,
    expected_guard,
    forget,
    guard_vector,
    predict,
    read_guard,
    record,
)
from popmesh.core.arrays import is_torch
from popmesh.core.errors import CollectiveMismatch, CommTimeout
from popmesh.core.handles import Pending
from popmesh.core.ops import ReduceOp

__all__ = ["checked", "start_checked", "Body", "StartBody"]

Body = Callable[[list[Any], float], Any]  # issues the payload and waits for it; returns the result
StartBody = Callable[[list[Any]], Pending]  # issues the payload and returns at once

_SIGNATURES: dict[Any, tuple[int, str]] = {}  # a call's key -> (signature, description)
_SIGNATURE_LIMIT = 1 << 16


def signature_of(key: Any, describe: Callable[[], str]) -> tuple[int, str]:
    """A call's signature and description, computed once per distinct ``key``."""
    known = _SIGNATURES.get(key)
    if known is None:
        if len(_SIGNATURES) >= _SIGNATURE_LIMIT:
            _SIGNATURES.clear()
        text = describe()
        known = _SIGNATURES[key] = (digest(text), text)
    return known


def checked(comm: Any, key: Any, describe: Callable[[], str], arrays: list[Any], body: Body,
            timeout: float, what: str) -> Any:
    """Run ``body(arrays, timeout)`` on every rank of ``comm`` once the call is known to match."""
    history: History = comm.history
    sig, text = _prologue(history, key, describe, what)
    predicted = predict(history)
    hit = sig == predicted
    vector = guard_vector(sig, hit, predicted, True)
    words = np.array(vector, dtype=np.int64)
    guard = comm.world.engine.all_reduce_start(words, ReduceOp.SUM, comm.handle)
    if hit:
        try:
            result = body(arrays, timeout)
        except CommTimeout as e:
            _explain_timeout(history, guard, words, vector, comm.size, text, what, e)
            raise
        guard.wait(timeout)
        if words.tolist() == expected_guard(vector, comm.size):
            history.last = sig  # a hit: the rest of the history is already so
            return result
    else:
        guard.wait(timeout)
    verdict = read_guard(words.tolist(), vector, comm.size)
    if not verdict.same:
        _mismatch(comm, history, verdict, hit, text, what, timeout)
    if not hit:
        result = body(arrays, timeout)
    if not verdict.in_step:
        forget(history)
    record(history, sig, lambda: _form_of(arrays, body))
    return result


def start_checked(comm: Any, key: Any, describe: Callable[[], str], arrays: list[Any], start: StartBody,
                  timeout: float, what: str) -> Pending:
    """Like :func:`checked` for a payload that runs in the background: a hit returns at once (the
    guard is checked when the work is waited for), a miss waits for the guard first."""
    history: History = comm.history
    sig, text = _prologue(history, key, describe, what)
    predicted = predict(history)
    hit = sig == predicted
    vector = guard_vector(sig, hit, predicted, False)
    words = np.array(vector, dtype=np.int64)
    guard = comm.world.engine.all_reduce_start(words, ReduceOp.SUM, comm.handle)
    if hit:
        history.last = sig  # what the history will be once the guard agrees; later calls predict from it
        return _Guarded(comm, guard, words, vector, start(arrays), text, what)
    guard.wait(timeout)
    verdict = read_guard(words.tolist(), vector, comm.size)
    if not verdict.same:
        _mismatch(comm, history, verdict, hit, text, what, timeout)
    if not verdict.in_step:
        forget(history)
    record(history, sig, lambda: _form_of(arrays, lambda a, t: start(a).wait(t)))
    return start(arrays)


class _Guarded:
    """A payload in flight beside its guard: the result counts only once the guard agrees."""

    def __init__(self, comm: Any, guard: Pending, words: np.ndarray, vector: list[int], body: Pending,
                 text: str, what: str) -> None:
        self._comm, self._guard, self._words, self._vector, self._body = comm, guard, words, vector, body
        self._text, self._what = text, what
        self._checked = False

    def done(self) -> bool:
        return bool(self._guard.done()) and bool(self._body.done())

    def wait(self, timeout: float) -> Any:
        if not self._checked:
            self._guard.wait(timeout)
            got = self._words.tolist()
            if got != expected_guard(self._vector, self._comm.size):
                verdict = read_guard(got, self._vector, self._comm.size)
                if not verdict.same:
                    self._body.wait(timeout)  # the other ranks complete it with zeros
                    _mismatch(self._comm, self._comm.history, verdict, True, self._text, self._what, timeout)
            self._checked = True
        return self._body.wait(timeout)


def _prologue(history: History, key: Any, describe: Callable[[], str], what: str) -> tuple[int, str]:
    if history.broken is not None:
        raise CollectiveMismatch(f"{what}: this group cannot be used any more: {history.broken}")
    return signature_of(key, describe)


def _mismatch(comm: Any, history: History, verdict: Verdict, hit: bool, text: str, what: str,
              timeout: float) -> None:
    """The guard found ranks with different calls: complete the payloads in flight, then raise on
    every rank (listing each rank's call when every rank can still exchange it)."""
    if not hit and verdict.any_hit:
        if not verdict.same_prediction:
            history.broken = (f"ranks called different collectives (this rank: {text}) while their call "
                              "histories disagreed, after an earlier mismatch with asynchronous calls in flight")
            raise CollectiveMismatch(f"{what}: {history.broken}")
        _complete_with_zeros(history.forms[predict(history)], timeout)
    forget(history)
    if verdict.describable:
        agree(comm, text, what, timeout)  # raises, naming every rank's call
    raise CollectiveMismatch(
        f"{what}: ranks called different collectives or passed different shapes or dtypes (this rank: "
        f"{text}); nothing was reduced or moved. Every rank of the group must call the same collective "
        "with the same structure, shapes and dtypes (POPMESH_CHECK=1 lists each rank's call)."
    )


def _explain_timeout(history: History, guard: Pending, words: np.ndarray, vector: list[int], size: int,
                     text: str, what: str, error: CommTimeout) -> None:
    """A hit's payload timed out: if the guard shows a mismatch no rank could complete, say so."""
    if not guard.done():
        return
    verdict = read_guard(words.tolist(), vector, size)
    if not verdict.same:
        history.broken = (f"ranks called different collectives (this rank: {text}) and the payloads in flight "
                          "could not be completed")
        raise CollectiveMismatch(f"{what}: {history.broken}") from error


def _form_of(arrays: list[Any], run: Body) -> Form:
    return Form(run, tuple(
        (True, a.dtype, tuple(a.shape), a.device) if is_torch(a) else (False, a.dtype, tuple(a.shape), None)
        for a in arrays
    ))


def _complete_with_zeros(form: Form, timeout: float) -> None:
    """Issue the payload of ``form`` with zeros: its result is thrown away."""
    zeros: list[Any] = []
    for torch_leaf, dtype, shape, device in form.leaves:
        if torch_leaf:
            import torch

            zeros.append(torch.zeros(shape, dtype=dtype, device=device))
        else:
            zeros.append(np.zeros(shape, dtype=dtype))
    form.run(zeros, timeout)
