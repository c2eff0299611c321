"""The always-on check of sized collectives: a one-word guard all-reduce beside (or before) the payload.

See :mod:`popmesh.comm.signature` for why it is sound. A call whose signature is the group's
prediction runs its guard beside its payload where the engine overlaps collectives (and always for
asynchronous calls, whose point is to return at once); any other call waits for its guard first.
A mismatch raises :class:`CollectiveMismatch` on every rank, listing each rank's call (exchanged as
point-to-point messages, which need no agreement on what comes next), and no engine ever pairs
payloads of different forms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from popmesh.comm.messages import internal_tag, isend, recv
from popmesh.comm.signature import Form, History, agrees, digest, forget, guard_word, predict, record
from popmesh.core.arrays import is_torch
from popmesh.core.errors import CollectiveMismatch, CommTimeout, PopmeshError
from popmesh.core.handles import Pending
from popmesh.core.ops import ReduceOp

__all__ = ["checked", "start_checked", "signature_of", "Body", "StartBody", "MISMATCH_TAG"]

Body = Callable[[list[Any], float], Any]  # issues the payload and waits for it; returns the result
StartBody = Callable[[list[Any]], Pending]  # issues the payload and returns at once

MISMATCH_TAG = internal_tag(128)  # each rank's description of a mismatched call
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


def checked(comm: Any, key: Any, describe: Callable[[], str], arrays: list[Any], body: Body,
            timeout: float, what: str) -> Any:
    """Run ``body(arrays, timeout)`` on every rank of ``comm`` once the call is known to match."""
    history: History = comm.history
    sig, text = _prologue(history, key, describe, what)
    predicted = history.after.get(history.last, 0)  # predict(history), inline: small calls' latency lives here
    engine = comm.world.engine
    overlap = engine.tuning.overlap_from_bytes
    hit = sig == predicted and (overlap == 0 or sum(int(a.nbytes) for a in arrays) >= overlap)
    size = comm.size
    word = np.array([guard_word(sig)], dtype=np.int64)
    guard = engine.all_reduce_start(word, ReduceOp.SUM, comm.handle)
    if hit:
        try:
            result = body(arrays, timeout)
        except CommTimeout as e:
            if guard.done() and not agrees(int(word[0]), sig, size):
                raise _mismatch(comm, history, hit, predicted, text, what, timeout) from e
            raise
        guard.wait(timeout)
        if agrees(int(word[0]), sig, size):
            history.last = sig  # a hit: the rest of the history is already so
            return result
        raise _mismatch(comm, history, hit, predicted, text, what, timeout)
    guard.wait(timeout)
    if not agrees(int(word[0]), sig, size):
        raise _mismatch(comm, history, hit, predicted, text, what, timeout)
    result = body(arrays, timeout)
    record(history, sig, lambda: _form_of(arrays, body))
    return result


def start_checked(comm: Any, key: Any, describe: Callable[[], str], arrays: list[Any], start: StartBody,
                  timeout: float, what: str) -> Pending:
    """Like :func:`checked` for a payload that runs in the background: a hit returns at once (the
    guard is checked when the work is waited for), a miss waits for the guard first."""
    history: History = comm.history
    sig, text = _prologue(history, key, describe, what)
    predicted = predict(history)
    word = np.array([guard_word(sig)], dtype=np.int64)
    guard = comm.world.engine.all_reduce_start(word, ReduceOp.SUM, comm.handle)
    if sig == predicted:
        history.last = sig  # what the history will be once the guard agrees; later calls predict from it
        return _Guarded(comm, guard, word, sig, predicted, start(arrays), text, what)
    guard.wait(timeout)
    if not agrees(int(word[0]), sig, comm.size):
        raise _mismatch(comm, history, False, predicted, text, what, timeout)
    record(history, sig, lambda: _form_of(arrays, lambda a, t: start(a).wait(t)))
    return start(arrays)


class _Guarded:
    """A payload in flight beside its guard: the result counts only once the guard agrees."""

    def __init__(self, comm: Any, guard: Pending, word: np.ndarray, sig: int, predicted: int, body: Pending,
                 text: str, what: str) -> None:
        self._comm, self._guard, self._word, self._body = comm, guard, word, body
        self._sig, self._predicted, self._text, self._what = sig, predicted, text, what
        self._number = comm.history.issued
        self._checked = False

    def done(self) -> bool:
        return bool(self._guard.done()) and bool(self._body.done())

    def wait(self, timeout: float) -> Any:
        if not self._checked:
            self._guard.wait(timeout)
            if not agrees(int(self._word[0]), self._sig, self._comm.size):
                self._body.wait(timeout)  # the other ranks complete it with zeros
                history: History = self._comm.history
                if history.issued != self._number:  # later calls went out predicted from this one
                    history.broken = (f"a mismatch ({self._text} on this rank) was found while later calls of "
                                      "the group were in flight")
                raise _mismatch(self._comm, history, True, self._predicted, self._text, self._what, timeout)
            self._checked = True
        return self._body.wait(timeout)


def _prologue(history: History, key: Any, describe: Callable[[], str], what: str) -> tuple[int, str]:
    if history.broken is not None:
        raise CollectiveMismatch(f"{what}: this group cannot be used any more: {history.broken}")
    history.issued += 1
    return signature_of(key, describe)


def _mismatch(comm: Any, history: History, issued: bool, predicted: int, text: str, what: str,
              timeout: float) -> CollectiveMismatch:
    """The guard found ranks with different calls. Every rank that has not issued a payload for this
    call issues the predicted one with zeros (a rank that hit issued it already), so the group is
    left clean; then the ranks exchange their calls' descriptions for the error every rank raises."""
    if not issued and predicted:
        _complete_with_zeros(history.forms[predicted], timeout)
    forget(history)
    per_rank = _exchange_descriptions(comm, text, timeout)
    listing = "; ".join(f"rank {r}: {t}" for r, t in per_rank.items())
    return CollectiveMismatch(
        f"{what}: ranks called different collectives or passed different shapes or dtypes ({listing}); "
        "nothing was returned. Every rank of the group must call the same collective with the same "
        "structure, shapes and dtypes.",
        per_rank,
    )


def _exchange_descriptions(comm: Any, text: str, timeout: float) -> dict[int, str]:
    """Every member's description, as messages: ranks that overlapped an asynchronous call may
    already have later collectives in flight, so no further collective can be trusted to pair."""
    me = comm.rank
    others = [r for r in comm.ranks if r != me]
    sends = [isend(text, r, MISMATCH_TAG, timeout=timeout) for r in others]
    texts = {me: text}
    try:
        for r in others:
            texts[r] = str(recv(r, MISMATCH_TAG, timeout=timeout)[1])
        for handle in sends:
            handle.wait()
    except PopmeshError as e:  # a rank that never got here: say what is known
        texts.update({r: f"(no description: {type(e).__name__})" for r in others if r not in texts})
    return {r: texts[r] for r in comm.ranks}


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
