"""Call signatures and the prediction that lets the always-on check overlap the payload (pure).

Every sized collective has a *signature*: a 62-bit digest of its description (collective, op, root,
structure, dtypes and shapes). Before its payload moves, every rank of the group contributes a small
*guard*, two int64 words, to one SUM all-reduce: the signature ``s`` (the sum is ``n * s`` iff every
rank has the same) and a word counting the ranks that hit and that block, with a digest of the
prediction ``q`` (:func:`guard_vector`).

The guard costs a latency round, so it runs *beside* the payload whenever that is safe. Only verified
calls enter a group's :class:`History`, so the history is the same on every rank, and so is the
prediction made from it (the signature that last followed the previous call). A rank whose call is
the prediction (a *hit*) issues the guard and the payload together; a rank whose call is not waits
for the guard first. The payloads that meet are therefore always of one form: either every rank's
signature is the same, or the only payloads in flight are the hitters', all of the predicted form,
and the other ranks complete them with a zero payload of that form (:class:`Form`), so the group is
left clean. The engines never see two different payload sizes, which gloo would answer by aborting
the process and MPI with truncated or partly reduced data.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "MASK", "MAX_GROUP", "digest", "Form", "History", "predict", "record", "forget", "guard_vector", "expected_guard",
    "Verdict", "read_guard",
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
    signature followed which, and the form of each. ``broken`` is set when a mismatch left payloads
    in flight that no rank can complete (the group is then unusable)."""

    last: int = 0
    after: dict[int, int] = field(default_factory=dict)
    forms: dict[int, Form] = field(default_factory=dict)
    broken: str | None = None


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
_COUNT_BITS = 21  # hit and blocking counts: groups of up to 2**21 - 1 ranks
_Q_SHIFT = 2 * _COUNT_BITS
_Q_MASK = (1 << (64 - _Q_SHIFT)) - 1
MAX_GROUP = (1 << _COUNT_BITS) - 1


def guard_vector(signature: int, hit: bool, predicted: int, blocking: bool) -> list[int]:
    """This rank's two words for the guard's SUM all-reduce (``blocking``: the call returns only when
    its payload is done, so it issues nothing else on the group before it learns the verdict).

    Word 0 is the signature; word 1 packs ``hit`` and ``blocking`` as counts (21 bits each) and a
    22-bit digest of the prediction on top. Sums wrap modulo 2**64, so the top field sums the
    digests modulo 2**22 and the counts stay exact. (Two words, not more: gloo's all-reduce of three
    or more elements takes several times as long as one of one or two.)
    """
    packed = int(hit) | (int(blocking) << _COUNT_BITS) | ((predicted & _Q_MASK) << _Q_SHIFT)
    return [_signed(signature), _signed(packed)]


def _signed(word: int) -> int:
    word %= _WORD
    return word - _WORD if word >= 1 << 63 else word


class Verdict(NamedTuple):
    """What the guard's result says, from this rank's own view (see :func:`read_guard`)."""

    same: bool  # every rank has the same signature: the payloads match
    any_hit: bool  # some rank issued its payload beside the guard
    all_hit: bool  # every rank did
    same_prediction: bool  # every rank predicted the same call (so knows the hitters' payload form)
    all_blocking: bool  # no rank's call is asynchronous

    @property
    def in_step(self) -> bool:
        """Whether the ranks' histories still agree (hits are all or none, predictions equal)."""
        return self.same_prediction and self.any_hit == self.all_hit

    @property
    def completable(self) -> bool:
        """After a mismatch: whether the ranks that did not hit can complete the hitters' payloads."""
        return not self.any_hit or self.same_prediction

    @property
    def describable(self) -> bool:
        """After a mismatch: whether every rank is at this call, so that all can exchange descriptions
        (no rank hit, so all waited for the guard; or every call blocks until it is checked)."""
        return not self.any_hit or self.all_blocking


def expected_guard(mine: list[int], size: int) -> list[int]:
    """The guard's result when every rank of ``size`` contributed ``mine``: the fast path's test."""
    return [_signed(word * size) for word in mine]


def read_guard(result: Any, mine: list[int], size: int) -> Verdict:
    """The verdict from the guard's summed words, given this rank's own words and the group size.

    Signatures are 62-bit digests: ``sum == size * mine`` modulo 2**64 holds iff all are equal (in
    a group of two exactly; in larger ones but for sums that cancel by chance, odds about 2**-60).
    """
    total_s, packed = (int(v) % _WORD for v in result)
    own_s, own_packed = (v % _WORD for v in mine)
    count_mask = (1 << _COUNT_BITS) - 1
    hits, blocking = packed & count_mask, (packed >> _COUNT_BITS) & count_mask
    own_q = own_packed >> _Q_SHIFT
    return Verdict(
        same=total_s == (own_s * size) % _WORD,
        any_hit=hits > 0,
        all_hit=hits == size,
        same_prediction=(packed >> _Q_SHIFT) == (own_q * size) & _Q_MASK,
        all_blocking=blocking == size,
    )
