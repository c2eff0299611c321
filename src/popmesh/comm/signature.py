"""Call signatures, the prediction that lets the always-on check ride with the payload, and the
sentinels that make a payload carry its own check (pure).

Every sized collective has a *signature*: a 62-bit digest of its description (collective, op, root,
structure, dtypes and shapes). Only verified calls enter a group's :class:`History`, so the history is
the same on every rank, and so is the prediction made from it (the signature that followed the
previous call the last two times, :func:`predict`). A rank whose call is the prediction is a *hit*.

Two ways to check a call, chosen by the predicted call's form (the same on every rank):

- **Carried** (the predicted form has a :class:`Sentinel`: a one-array reduction of floats, or a
  MAX/MIN of integers or booleans). A hit issues its payload alone. A rank whose call is not the
  prediction issues the predicted payload with zeros and the sentinel in element 0 instead, which
  makes element 0 of every rank's result recognisable (NaN or infinite for floats, the extreme value
  for MAX/MIN of integers). Only a flagged result costs a round: the *guard*, below. So a repeated
  call costs nothing but reading one element of its result.
- **Guarded** (anything else). Every rank contributes its signature to one SUM all-reduce of one
  int64 word, the guard: the sum is ``n * s`` iff every rank has the same ``s`` (:func:`agrees`). A
  hit may issue its guard beside its payload where the engine overlaps collectives; other calls wait
  for the guard first.

Either way the payloads that meet are of one form: every rank's own, once verified, or the predicted
one (a rank that did not issue it after a disagreeing guard issues it with zeros, :class:`Form`). The
engines never see two payload sizes, which gloo would answer by aborting the process and MPI with
truncated or partly reduced data.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from popmesh.core.ops import Lowering, ReduceOp

__all__ = [
    "MASK", "digest", "Sentinel", "sentinel_for", "Form", "History", "predict", "advance", "record", "forget",
    "count_as_predicted", "guard_word", "expected_sum", "agrees", "rest_predicted",
]

MASK = (1 << 62) - 1
"""Signatures and predictions live in [1, 2**62): their negations fit an int64, and 0 means none."""

_HISTORY_LIMIT = 4096  # distinct transitions kept per group before the history starts again


def digest(text: str) -> int:
    """A 62-bit digest of ``text``, the same in every process (never 0: 0 means 'no prediction')."""
    raw = text.encode()
    return (((zlib.crc32(raw) << 32) | zlib.adler32(raw)) & MASK) or 1


@dataclass(frozen=True)
class Sentinel:
    """What a rank whose call is not the prediction writes into element 0 of the predicted payload
    (zeros elsewhere), and how every rank recognises it in element 0 of the result: not finite
    (floats: NaN survives SUM and PROD, +inf MAX and -inf MIN, whatever the order of reduction), or
    equal to ``value`` (integers: no other contribution passes the extreme of MAX or MIN). A flagged
    result may also be the data's own (a NaN in element 0): then the guard decides."""

    value: float | int
    nonfinite: bool  # flagged when element 0 is not finite; else when it equals ``value``
    as_bytes: bool  # element 0 is written and read as a byte (booleans, reduced as their bytes)

    def flags(self, first: float | int) -> bool:
        """Whether element 0 of a result, ``first``, may carry a sentinel."""
        if self.nonfinite:
            return not math.isfinite(first)
        return bool(first == self.value)


_FLOATS = ("float16", "bfloat16", "float32", "float64")
_INTS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "uint8": 8}  # torch cannot write uint64's maximum


def sentinel_for(dtype: str, lowering: Lowering, numel: int) -> Sentinel | None:
    """The sentinel of a one-buffer reduction of ``numel`` elements of ``dtype`` (None: the call is
    checked by the guard). SUM and PROD of integers have none (every value can be a real result), nor
    does MIN of booleans or unsigned integers (its extreme, 0, is ordinary data)."""
    op = lowering.engine_op
    if numel == 0:
        return None
    if lowering.as_bytes:
        return Sentinel(255, False, True) if op is ReduceOp.MAX else None
    if dtype in _FLOATS:
        value = math.inf if op is ReduceOp.MAX else -math.inf if op is ReduceOp.MIN else math.nan
        return Sentinel(value, True, False)
    bits = _INTS.get(dtype)
    if bits is None or op not in (ReduceOp.MAX, ReduceOp.MIN):
        return None
    signed = dtype.startswith("int")
    if op is ReduceOp.MAX:
        return Sentinel((1 << (bits - 1)) - 1 if signed else (1 << bits) - 1, False, False)
    return Sentinel(-(1 << (bits - 1)), False, False) if signed else None  # unsigned MIN: 0 is common data


@dataclass(frozen=True)
class Form:
    """How to issue a call's payload again without its data: ``run(arrays, timeout)`` makes the
    same engine calls as the original, and ``leaves`` are ``(is_torch, dtype, shape, device)`` of
    the arrays it takes (a rank completes a mismatched payload with zeros of this form).
    ``sentinel``: set where the payload carries its own check (a one-buffer blocking reduction)."""

    run: Callable[[list[Any], float], Any]
    leaves: tuple[tuple[bool, Any, tuple[int, ...], Any], ...]
    sentinel: Sentinel | None = None
    signature: int = 0
    key: Any = None  # the cache key of the call that recorded it: a call with this key is this form
    text: str = ""  # the call's description
    flagged: Callable[[Any], bool] | None = None  # whether a result of this form may carry the sentinel
    finite_item: bool = False  # for a numpy result, flagged is ``not isfinite(result.item(0))`` (written inline)
    reader: Any = None  # the ctypes type of one element, to read a CPU tensor's element 0 in place (inline too)
    lowering: Lowering | None = None  # a carried reduction's lowering, reused by calls of this form (same op, dtype)


@dataclass
class History:
    """The verified calls of one group, identical on every member at each call: the last signature,
    which signature followed which (``after``: seen twice in a row, so predicted; ``pending``: seen
    once), and the form of each. ``issued`` numbers the group's calls (the same on every rank);
    ``mismatched``: the number of the last call found to mismatch here (for error messages only)."""

    last: int = 0
    after: dict[int, int] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)
    forms: dict[int, Form] = field(default_factory=dict)
    issued: int = 0  # the group's calls so far, this one included: a call's number, the same on every rank
    mismatched: int = 0
    carried: Form | None = None  # the prediction's form where it carries its check (kept by advance/record)


def predict(history: History) -> int:
    """The signature expected next (0: none), the same on every rank whose history is the same: the
    one seen to follow the last call twice in a row."""
    return history.after.get(history.last, 0)


def advance(history: History, signature: int) -> None:
    """The group's last call is now ``signature`` (a predicted one: ``after`` is unchanged)."""
    if history.last != signature:
        history.last = signature
        history.carried = _carried_prediction(history)


def _carried_prediction(history: History) -> Form | None:
    form = history.forms.get(history.after.get(history.last, 0))
    return form if form is not None and form.sentinel is not None else None


def record(history: History, signature: int, form: Form | Callable[[], Form]) -> None:
    """Enter a verified call that was not predicted (``form`` may be a function that builds it, called
    only when new). A transition is predicted once seen twice in a row, and no longer once it failed:
    where a rank's own call is not the prediction, every rank may pay for a payload of the predicted
    form (see :class:`Sentinel`), so a pattern that keeps changing is not guessed at."""
    if len(history.pending) >= _HISTORY_LIMIT and history.last not in history.pending:
        forget(history)  # the same on every rank: the history is
    last = history.last
    if history.after.get(last) != signature:
        if history.pending.get(last) == signature:
            history.after[last] = signature
        else:
            history.pending[last] = signature
            history.after.pop(last, None)
    history.last = signature
    if signature not in history.forms:
        history.forms[signature] = form if isinstance(form, Form) else form()
    history.carried = _carried_prediction(history)


def forget(history: History) -> None:
    """Start the history again (every rank does so at the same call)."""
    history.last = 0
    history.after.clear()
    history.pending.clear()
    history.forms.clear()
    history.carried = None


def count_as_predicted(history: History, predicted: int) -> None:
    """Enter a call found to mismatch where it was made: as the prediction (none: the history stays).

    A rank whose call was an asynchronous prediction (a *hit*) entered it so when it started the call
    and may have started later calls predicted from there before the mismatch is found at ``wait()``;
    every other rank enters it the same way where it finds the mismatch, so the history stays the
    same on every rank at every call, and so do the engine calls that each later call makes. (Without
    a prediction no rank went ahead: every rank found the mismatch at the call itself.)"""
    if predicted:
        advance(history, predicted)


_WORD = 1 << 64


def guard_word(signature: int) -> int:
    """This rank's word for the guard's SUM all-reduce: the signature itself.

    One word, not more: gloo's all-reduce of one element is its cheapest collective (two took
    twice as long on the 2-vCPU box, three or more several times as long)."""
    return signature


def expected_sum(signature: int, size: int) -> int:
    """The guard's result (as int64) when every rank of ``size`` has ``signature``."""
    total = (signature * size) % _WORD
    return total - _WORD if total >= 1 << 63 else total


def agrees(total: int, signature: int, size: int) -> bool:
    """Whether the guard's sum says every rank has ``signature``. Sums wrap modulo 2**64 as the
    engines' int64 sums do; with 62-bit signatures the test is exact in a group of two (``s0 + s1 ==
    2 * s0`` iff ``s1 == s0``), and in a larger group fails only if the other ranks' differing
    digests happen to sum to the same value (odds about 2**-60 for a given set of calls)."""
    return total % _WORD == (signature * size) % _WORD


def rest_predicted(total: int, heard: list[int], unheard: int, predicted: int) -> bool:
    """Whether the guard's sum ``total`` is what the ``unheard`` ranks contribute if each made the
    predicted call, given the signatures ``heard`` of the others (this rank's included).

    After a mismatch, a rank whose call is not the prediction tells every other rank its call; a rank
    whose call is the prediction says nothing (it may be busy with later calls, and the others know
    its call). A rank stops listening once the ranks not heard from are accounted for this way, so no
    rank ever waits for one that went ahead. Exact as :func:`agrees` is: the unheard ranks' sum could
    match by chance only if some of them differ (odds about 2**-60)."""
    return (total - sum(heard)) % _WORD == (unheard * predicted) % _WORD
