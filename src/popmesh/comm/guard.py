"""The always-on check of sized collectives: carried in the payload, or a one-word guard all-reduce.

See :mod:`popmesh.comm.signature` for why it is sound. A call that is the group's prediction, where
the predicted call's payload can carry a sentinel (a blocking all_reduce of one array), runs its
payload alone and settles it by reading element 0 of the result (:func:`carried_hit`,
:func:`settle`); a rank whose call is not the prediction issues the predicted payload with the
sentinel, and a flagged result costs one guard round. Every other call has a guard, beside its
payload when it is the prediction and the engine overlaps collectives (always for asynchronous calls,
whose point is to return at once), before it otherwise. A mismatch raises
:class:`CollectiveMismatch` on every rank, listing each rank's call (:mod:`popmesh.comm.mismatch`),
and no engine ever pairs payloads of different forms: the mismatched call counts in the history as
the prediction on every rank (:func:`~popmesh.comm.signature.count_as_predicted`), so calls that ranks
started after it, before they found the mismatch at ``wait()``, meet the same calls on every rank.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from popmesh.comm.mismatch import Mismatched, describe_ranks, mismatch_error
from popmesh.comm.reduction import first_element, set_first_
from popmesh.comm.signature import (
    Form,
    History,
    Sentinel,
    advance,
    agrees,
    count_as_predicted,
    digest,
    guard_word,
    predict,
    record,
    sentinel_for,
)
from popmesh.core.arrays import dtype_name, is_torch
from popmesh.core.errors import CollectiveMismatch, CommTimeout
from popmesh.core.handles import Pending
from popmesh.core.ops import Lowering, ReduceOp

__all__ = ["checked", "carried_hit", "settle", "start_checked", "signature_of", "Body", "StartBody"]

Body = Callable[[list[Any], float], Any]  # issues the payload and waits for it; returns the result
StartBody = Callable[[list[Any]], Pending]  # issues the payload and returns at once

_isfinite = math.isfinite
_READERS = {"float32": ctypes.c_float, "float64": ctypes.c_double}  # element 0 of a CPU tensor, read in place
_SIGNATURES: dict[Any, tuple[int, str]] = {}  # a call's key -> (signature, description)
_CACHE_LIMIT = 1 << 16


def signature_of(key: Any, describe: Callable[[], str]) -> tuple[int, str]:
    """A call's signature and description, computed once per distinct ``key``."""
    known = _SIGNATURES.get(key)
    if known is None:
        if len(_SIGNATURES) >= _CACHE_LIMIT:
            _SIGNATURES.clear()
        text = describe()
        known = _SIGNATURES[key] = (digest(text), text)
    return known


def carried_hit(history: History, key: Any) -> Form | None:
    """The group's predicted call where it carries its check and this call (``key``) is it: then the
    caller issues its payload alone and hands the result to :func:`settle`. None: use :func:`checked`.
    (A caller that knows its key's layout may compare ``history.carried.key`` itself, as the one-array
    all_reduce does: building the key costs a small call's latency.)"""
    carried = history.carried
    return carried if carried is not None and key == carried.key else None


def settle(comm: Any, form: Form, result: Any, timeout: float, what: str, writes_input: bool) -> Any:
    """``result`` of a :func:`carried_hit`'s payload, once known to match: at once unless element 0
    is flagged, else after a guard round (CollectiveMismatch if another rank's call differed)."""
    history: History = comm.history
    history.issued += 1
    if form.finite_item and type(result) is np.ndarray:
        flagged = not _isfinite(result.item(0))
    elif form.reader is not None and type(result) is not np.ndarray and result.is_cpu:
        flagged = not _isfinite(form.reader.from_address(result.data_ptr()).value)
    else:
        assert form.flagged is not None
        flagged = form.flagged(result)
    if not flagged:
        if history.last != form.signature:
            advance(history, form.signature)
        return result
    return _verify(comm, history, form.signature, form.signature, form.text, True, result, [], _no_payload, timeout,
                   what, None, writes_input)


def checked(comm: Any, key: Any, describe: Callable[[], str], arrays: list[Any], body: Body,
            timeout: float, what: str, *, carry: Lowering | None = None, writes_input: bool = False,
            beside: bool = True) -> Any:
    """Run ``body(arrays, timeout)`` on every rank of ``comm`` once the call is known to match.

    ``carry``: the call is one reduction of the one array ``arrays[0]`` lowered so, whose result
    ``body`` returns: its payload may carry its own check (:class:`~popmesh.comm.signature.Sentinel`).
    ``writes_input``: ``body`` writes into the caller's arrays (an in-place call).
    ``beside``: a predicted call may run ``body`` while the guard is in flight. False for bodies of
    several engine calls whose later calls depend on earlier results (sizes exchanged first): paired
    with another rank's different call those could ask for absurd memory before the guard answers."""
    history: History = comm.history
    carried = carried_hit(history, key)
    if carried is not None:
        return settle(comm, carried, body(arrays, timeout), timeout, what, writes_input)
    sig, text = _prologue(history, key, describe)
    form = history.carried  # the prediction, where it carries its check
    if form is not None:
        return _carried(comm, history, sig, form.signature, form, text, arrays, body, timeout, what, carry,
                        writes_input, key=key)
    predicted = history.after.get(history.last, 0)
    engine = comm.world.engine
    overlap = engine.tuning.overlap_from_bytes
    hit = beside and sig == predicted and (overlap == 0 or sum(int(a.nbytes) for a in arrays) >= overlap)
    size = comm.size
    word = np.array([guard_word(sig)], dtype=np.int64)
    guard = engine.all_reduce_start(word, ReduceOp.SUM, comm.handle)
    if hit:
        try:
            result = body(arrays, timeout)
        except CommTimeout as e:
            if guard.done() and not agrees(int(word[0]), sig, size):
                raise _mismatch(comm, True, predicted, sig, text, int(word[0]), what, timeout, writes_input) from e
            raise
        guard.wait(timeout)
        if agrees(int(word[0]), sig, size):
            advance(history, sig)  # a hit: the rest of the history is already so
            return result
        raise _mismatch(comm, True, predicted, sig, text, int(word[0]), what, timeout, writes_input)
    guard.wait(timeout)
    if not agrees(int(word[0]), sig, size):
        raise _mismatch(comm, False, predicted, sig, text, int(word[0]), what, timeout)
    result = body(arrays, timeout)
    record(history, sig, lambda: _form_of(arrays, body, carry, sig, key, text))
    return result


def _carried(comm: Any, history: History, sig: int, predicted: int, form: Form, text: str, arrays: list[Any],
             body: Body, timeout: float, what: str, carry: Lowering | None, writes_input: bool, *, key: Any,
             replay: Body | None = None) -> Any:
    """The predicted call carries its own check: a hit issues its payload alone and is done unless
    element 0 of the result is flagged; any other call issues the predicted payload with the sentinel
    (so every hit's result is flagged). Flagged results and misses take one guard round (``replay``:
    how the call's own payload is issued again, by default ``body``)."""
    assert form.flagged is not None
    result = None
    hit = sig == predicted
    if hit:
        result = body(arrays, timeout)
        if not form.flagged(result):
            advance(history, sig)
            return result
    else:
        _complete_with_zeros(form, timeout, flagged=True)
    return _verify(comm, history, sig, predicted, text, hit, result, arrays, body, timeout, what, carry,
                   writes_input, key, body if replay is None else replay)


def _verify(comm: Any, history: History, sig: int, predicted: int, text: str, hit: bool, result: Any,
            arrays: list[Any], body: Body, timeout: float, what: str, carry: Lowering | None,
            writes_input: bool, key: Any = None, replay: Body | None = None) -> Any:
    """The guard round after a carried prediction's payload, which every rank has issued: a hit whose
    result was flagged returns it if every rank agrees (the data's own NaN or extreme value); a miss
    runs ``body`` if every rank left the prediction for the same call, and records ``replay``."""
    word = np.array([guard_word(sig)], dtype=np.int64)
    comm.world.engine.all_reduce_(word, ReduceOp.SUM, comm.handle, timeout)
    if not agrees(int(word[0]), sig, comm.size):
        raise _mismatch(comm, True, predicted, sig, text, int(word[0]), what, timeout, hit and writes_input)
    if hit:
        advance(history, sig)
        return result
    result = body(arrays, timeout)
    record(history, sig, lambda: _form_of(arrays, body if replay is None else replay, carry, sig, key, text))
    return result


def start_checked(comm: Any, key: Any, describe: Callable[[], str], arrays: list[Any], start: StartBody,
                  timeout: float, what: str, *, writes_input: bool = False) -> Pending:
    """Like :func:`checked` for a payload that runs in the background: a hit returns at once (the
    guard is checked when the work is waited for), a miss waits for the guard first. Background calls
    never carry their check (a flagged result found at ``wait()`` would need a round after the later
    calls already in flight): ``key`` and ``describe`` must tell them from blocking calls."""
    history: History = comm.history
    sig, text = _prologue(history, key, describe)
    carried = history.carried
    if carried is not None:  # a miss of a carried prediction
        _carried(comm, history, sig, carried.signature, carried, text, arrays, _no_payload, timeout,
                 what, None, False, key=key, replay=lambda a, t: start(a).wait(t))
        return start(arrays)
    predicted = predict(history)
    word = np.array([guard_word(sig)], dtype=np.int64)
    guard = comm.world.engine.all_reduce_start(word, ReduceOp.SUM, comm.handle)
    if sig == predicted:
        advance(history, sig)  # what the history will be once the guard agrees; later calls predict from it
        return _Guarded(comm, guard, word, sig, start(arrays), text, what, writes_input)
    guard.wait(timeout)
    if not agrees(int(word[0]), sig, comm.size):
        raise _mismatch(comm, False, predicted, sig, text, int(word[0]), what, timeout)
    record(history, sig, lambda: _form_of(arrays, lambda a, t: start(a).wait(t), None, sig, key, text))
    return start(arrays)


def _no_payload(arrays: list[Any], timeout: float) -> None:
    return None


class _Guarded:
    """A payload in flight beside its guard: the result counts only once the guard agrees."""

    def __init__(self, comm: Any, guard: Pending, word: np.ndarray, sig: int, body: Pending, text: str,
                 what: str, writes_input: bool) -> None:
        self._comm, self._guard, self._word, self._body = comm, guard, word, body
        self._sig, self._text, self._what = sig, text, what
        self._writes_input = writes_input
        self._number = comm.history.issued  # this call's number on the group
        self._checked = False

    def done(self) -> bool:
        return bool(self._guard.done()) and bool(self._body.done())

    def wait(self, timeout: float) -> Any:
        if not self._checked:
            self._guard.wait(timeout)
            total = int(self._word[0])
            if not agrees(total, self._sig, self._comm.size):
                self._body.wait(timeout)  # the other ranks complete it with zeros
                raise _mismatch(self._comm, True, self._sig, self._sig, self._text, total, self._what, timeout,
                                self._writes_input, number=self._number)
            self._checked = True
        return self._body.wait(timeout)


def _prologue(history: History, key: Any, describe: Callable[[], str]) -> tuple[int, str]:
    history.issued += 1
    known = _SIGNATURES.get(key)  # inline: small calls' latency is spent on this path
    return known if known is not None else signature_of(key, describe)


def _mismatch(comm: Any, issued: bool, predicted: int, sig: int, text: str, total: int, what: str,
              timeout: float, overwritten: bool = False, *, number: int = 0) -> CollectiveMismatch:
    """The guard (sum ``total``) found ranks with different calls. Every rank that has not issued a
    payload for this call issues the predicted one with zeros (a rank that hit issued it already), so
    the group is left clean, and enters the call as the prediction; then every rank learns each
    rank's call for the error it raises. ``number``: set where the call's mismatch is found at
    ``wait()``, after the call entered the history and later calls may have started (0: found where
    the call is made). ``overwritten``: this rank's in-place payload ran, so its input holds a
    discarded result."""
    history: History = comm.history
    predicted_text = text if sig == predicted else history.forms[predicted].text if predicted else ""
    if not issued and predicted:
        _complete_with_zeros(history.forms[predicted], timeout)
    later = history.issued - number if number else 0
    if not number:
        number = history.issued
        count_as_predicted(history, predicted)
    since = number - history.mismatched if 0 < history.mismatched < number else 0
    history.mismatched = max(history.mismatched, number)
    call = Mismatched(comm.spec.gid, number, sig, text, predicted, predicted_text, total)
    return mismatch_error(what, describe_ranks(comm, call, timeout), overwritten=overwritten, later=later,
                          since=since)


def _form_of(arrays: list[Any], run: Body, carry: Lowering | None, sig: int, key: Any, text: str) -> Form:
    leaves = tuple(
        (True, a.dtype, tuple(a.shape), a.device) if is_torch(a) else (False, a.dtype, tuple(a.shape), None)
        for a in arrays
    )
    sentinel = None if carry is None else sentinel_for(dtype_name(arrays[0]), carry, math.prod(leaves[0][2]))
    if sentinel is None:
        return Form(run, leaves, None, sig, key, text)
    reader = _READERS.get(dtype_name(arrays[0])) if sentinel.nonfinite else None
    return Form(run, leaves, sentinel, sig, key, text, _flagged(sentinel), sentinel.nonfinite, reader, carry)


def _flagged(sentinel: Sentinel) -> Callable[[Any], bool]:
    """The test of a result for ``sentinel`` (numpy or torch alike: a call with the same signature
    may pass the other kind of array)."""
    return lambda result: sentinel.flags(first_element(result, sentinel.as_bytes))


def _complete_with_zeros(form: Form, timeout: float, flagged: bool = False) -> None:
    """Issue the payload of ``form`` with zeros (``flagged``: and its sentinel in element 0): its
    result is thrown away."""
    zeros: list[Any] = []
    for torch_leaf, dtype, shape, device in form.leaves:
        if torch_leaf:
            import torch

            zeros.append(torch.zeros(shape, dtype=dtype, device=device))
        else:
            zeros.append(np.zeros(shape, dtype=dtype))
    if flagged and form.sentinel is not None:
        set_first_(zeros[0], form.sentinel.value, form.sentinel.as_bytes)
    form.run(zeros, timeout)
