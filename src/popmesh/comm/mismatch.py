"""What every rank learns once the guard (:mod:`popmesh.comm.guard`) finds ranks with different
calls: each rank's call, and the :class:`CollectiveMismatch` every rank raises.

The descriptions travel as point-to-point messages, which need no agreement on what comes next. Only
a rank whose call was not the group's prediction sends its own: a rank whose call was the prediction
may have gone ahead (an asynchronous call finds its mismatch at ``wait()``, perhaps after this rank
started later calls or a blocking one), and the others know its call already. Each rank listens only
until the guard's sum is accounted for (:func:`~popmesh.comm.signature.rest_predicted`), so no rank
ever waits for one that went ahead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from popmesh.comm.agreement import device_advice
from popmesh.comm.messages import GUARD_TAGS, INTERNAL_TAG_BASE, SendHandle, internal_tag, isend, recv
from popmesh.comm.signature import rest_predicted
from popmesh.core.errors import CollectiveMismatch, PopmeshError

__all__ = ["MISMATCH_TAG", "Mismatched", "describe_ranks", "mismatch_error"]

MISMATCH_TAG = internal_tag(GUARD_TAGS.start - INTERNAL_TAG_BASE)  # each rank's description of a mismatched call
_EARLY_LIMIT = 256
_early: dict[tuple[int, int, int], tuple[int, str]] = {}  # (group, call, sender) -> its call: not yet asked for here
_sending: list[SendHandle] = []  # this rank's descriptions in flight, kept (with their buffers) until sent


@dataclass(frozen=True)
class Mismatched:
    """A call the guard found mismatched, as this rank knows it."""

    group: int  # the group's id (``GroupSpec.gid``)
    number: int  # the call's number on the group (``History.issued``), the same on every rank
    signature: int  # this rank's call
    text: str
    predicted: int  # the group's prediction for the call (0: none)
    predicted_text: str
    total: int  # the guard's sum


def describe_ranks(comm: Any, call: Mismatched, timeout: float) -> dict[int, str]:
    """Every member's description of ``call`` (keyed by global rank): told by the ranks whose call was
    not the prediction, the prediction's for the others. A rank that says nothing within ``timeout``
    (it failed, or the sum was not accounted for) is described by the error that ended the wait."""
    me = comm.rank
    others = [r for r in comm.ranks if r != me]
    _sending[:] = [h for h in _sending if not h.done()]
    if call.signature != call.predicted:
        message = [call.group, call.number, str(call.signature), call.text]
        _sending.extend(isend(message, r, MISMATCH_TAG, timeout=timeout) for r in others)
    heard = {me: (call.signature, call.text)}
    unheard = set(others)
    deadline = time.monotonic() + timeout
    try:
        while unheard and not rest_predicted(call.total, [s for s, _ in heard.values()], len(unheard),
                                             call.predicted):
            src, told = _next(call, unheard, deadline)
            heard[src] = told
            unheard.discard(src)
    except PopmeshError as e:  # a rank that never told: say what is known
        heard.update({r: (0, f"(no description: {type(e).__name__})") for r in unheard})
    _sending[:] = [h for h in _sending if not h.done()]
    return {r: heard[r][1] if r in heard else call.predicted_text for r in comm.ranks}


def _next(call: Mismatched, unheard: set[int], deadline: float) -> tuple[int, tuple[int, str]]:
    """The next description of ``call`` from one of ``unheard``; descriptions of other calls (another
    group's, or one this rank settles later: it waits for its handles in any order) are kept."""
    while True:
        for r in unheard:
            told = _early.pop((call.group, call.number, r), None)
            if told is not None:
                return r, told
        src, message = recv(frozenset(unheard), MISMATCH_TAG, timeout=max(deadline - time.monotonic(), 1e-3))
        group, number, signature, text = message
        if (group, number) == (call.group, call.number):
            return src, (int(signature), str(text))
        if len(_early) >= _EARLY_LIMIT:  # descriptions of calls this rank never waited for
            del _early[next(iter(_early))]
        _early[(group, number, src)] = (int(signature), str(text))


def mismatch_error(what: str, per_rank: dict[int, str], *, overwritten: bool, later: int = 0,
                   since: int = 0) -> CollectiveMismatch:
    """The error every rank raises. ``per_rank``: each rank's description of its call (global rank:
    text); where they name different device types (``float32[4]@cpu``, ``float32[4]@cuda:0``) the
    message says how to put the tensors on one kind. ``overwritten``: this rank's in-place payload
    ran; ``later``: calls this rank started on the group after this one; ``since``: how many calls
    before this one the group's previous mismatch was (0: none)."""
    listing = "; ".join(f"rank {r}: {t}" for r, t in per_rank.items())
    kept = ("this rank's input was overwritten: its in-place call had reduced it before the mismatch was found"
            if overwritten else "no input was written")
    text = (f"{what}: ranks called different collectives or passed different shapes, dtypes or devices "
            f"({listing}); nothing was returned, and {kept}. Every rank of the group must call the same collective "
            "with the same structure, shapes and dtypes, on the same kind of device."
            f"{device_advice(list(per_rank.values()))} The group stays usable: this call counts as made on every "
            "rank, so every rank goes on with the call after it (do not repeat or skip it on some ranks only).")
    if later:
        text += (f" The {later} call(s) this rank started on the group after it are not affected: each is "
                 "checked on its own.")
    if since:
        text += (f" This group's previous mismatch was {since} call(s) earlier: a rank that repeated or skipped a "
                 "call after catching that error is out of step with the others since.")
    return CollectiveMismatch(text, per_rank)
