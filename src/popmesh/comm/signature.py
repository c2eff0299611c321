"""Call signatures and the prediction that lets the always-on check overlap the payload (pure).

Every sized collective has a *signature*: a 62-bit digest of its description (collective, op, root,
structure, dtypes and shapes). Before its payload is trusted, every rank of the group contributes its
signature to one SUM all-reduce of one int64 word, the *guard*: the sum is ``n * s`` iff every rank
has the same ``s`` (:func:`agrees`).

The guard costs a latency round, so where the engine overlaps collectives it runs *beside* the
payload whenever that is safe. Only verified calls enter a group's :class:`History`, so the history is
the same on every rank, and so is the prediction made from it (the signature that last followed the
previous call). A rank whose call is the prediction (a *hit*) may issue the guard and the payload
together; any other rank waits for the guard first. The payloads that meet are therefore always of
one form: either every rank's signature is the same, or the only payloads in flight are the hitters',
all of the predicted form, and after the guard disagrees every rank that did not issue one issues a
zero payload of that form (:class:`Form`), so the group is left clean. The engines never see two
different payload sizes, which gloo would answer by aborting the process and MPI with truncated or
partly reduced data.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MASK", "digest", "Form", "History", "predict", "record", "forget", "guard_word", "expected_sum", "agrees",
]

MASK = (1 << 62) - 1
"""Signatures and predictions live in [1, 2**62): their negations fit an int64, and 0 means none."""

_HISTORY_LIMIT = 4096  # distinct transitions kept per group before the history starts again


def digest(text: str) -> int:
    """A 62-bit digest of ``text``, the same in every process (never 0: 0 means 'no prediction')."""
    raw = text.encode()
    return (((zlib.crc32(raw) << 32) | zlib.adler32(raw)) & MASK) or 1


@dataclass(frozen=True)
class Form:
    """How to issue a call's payload again without its data: ``run(arrays, timeout)`` makes the
    same engine calls as the original, and ``leaves`` are ``(is_torch, dtype, shape, device)`` of
    the arrays it takes (a rank completes a mismatched payload with zeros of this form)."""

    run: Callable[[list[Any], float], Any]
    leaves: tuple[tuple[bool, Any, tuple[int, ...], Any], ...]


@dataclass
class History:
    """The verified calls of one group, identical on every member: the last signature, which
    signature followed which, and the form of each. ``broken`` is set when a mismatch was found while
    this rank had later calls of the group in flight (the group is then unusable)."""

    last: int = 0
    after: dict[int, int] = field(default_factory=dict)
    forms: dict[int, Form] = field(default_factory=dict)
    broken: str | None = None
    issued: int = 0  # guarded calls issued on the group by this rank


def predict(history: History) -> int:
    """The signature expected next (0: none), the same on every rank whose history is the same."""
    return history.after.get(history.last, 0)


def record(history: History, signature: int, form: Form | Callable[[], Form]) -> None:
    """Enter a verified call (``form`` may be a function that builds it, called only when new)."""
    if len(history.after) >= _HISTORY_LIMIT and history.last not in history.after:
        forget(history)  # the same on every rank: the history is
    history.after[history.last] = signature
    history.last = signature
    if signature not in history.forms:
        history.forms[signature] = form if isinstance(form, Form) else form()


def forget(history: History) -> None:
    """Start the history again (every rank does so at the same call: after a mismatch)."""
    history.last = 0
    history.after.clear()
    history.forms.clear()


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
