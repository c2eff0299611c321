"""Generations of a world that re-forms after a lost rank: which attempt to join, and when all are there.

A world that outlives one of its ranks forms again, with the rank's restarted process, under a new
*generation*: a fresh process group over the same rendezvous store, its keys under the prefix of the
attempt that formed it. Ranks agree on the attempt through two keys of the store:

* ``ATTEMPT``: the newest attempt anyone has started, only ever raised by compare-and-set from a value
  its caller saw, so ranks that start a new attempt at the same time land on the same one;
* ``FORMED``: the newest attempt that formed a world.

A survivor of generation ``g`` asks for ``g + 1`` (or whatever is newer); a restarted process asks for
one past ``FORMED``, or past the newest attempt if its own rank's previous process had checked in
under that one (it died while the attempt formed, so that attempt cannot form); a rank whose attempt
failed asks for the next. An attempt forms in two steps, each awaited on every rank: every rank checks
in under it (:func:`await_members`), then, once its process group is up, says so (:func:`await_up`).
The second step matters because gloo may finish forming a group on some ranks although a member died
after publishing its address: no rank takes the attempt until every rank's group is up. Both waits
see a superseded attempt at once and move on instead of waiting out their timeout.

The logic is over a small store interface (``set``, ``get``, ``check``, ``compare_set``,
``multi_get``) so that it is tested with an in-memory store, without processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from popmesh.core.errors import CommTimeout

__all__ = ["ATTEMPT", "FORMED", "KeyStore", "Superseded", "prefix", "start_counting", "next_attempt",
           "newcomer_attempt", "check_in", "await_members", "mark_up", "await_up", "mark_formed", "newcomers",
           "newcomer_waiting", "restarted_ranks", "await_key", "poll_store"]

ATTEMPT = "popmesh/attempt"
FORMED = "popmesh/formed"


class KeyStore(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


class Superseded(Exception):
    """The attempt a rank waited in was replaced by a newer one (a rank failed while it formed)."""

    def __init__(self, attempt: int, newer: int) -> None:
        super().__init__(f"attempt {attempt} was superseded by attempt {newer}")
        self.attempt, self.newer = attempt, newer


def prefix(attempt: int) -> str:
    """The key prefix of a re-formed attempt's process group (the first world uses the store as it is)."""
    return f"popmesh/gen/{attempt}/pg"


def start_counting(store: KeyStore) -> None:
    """Create the counters at the first world (every rank may call it; only the first call sets them)."""
    store.compare_set(ATTEMPT, "", "0")


def next_attempt(store: KeyStore, after: int) -> int:
    """The attempt to join after ``after`` failed or its world lost a rank: ``after + 1`` unless newer exists."""
    return int(store.compare_set(ATTEMPT, str(after), str(after + 1)))


def newcomer_attempt(store: KeyStore, rank: int, timeout: float) -> int:
    """The attempt a restarted process for ``rank`` joins: one past the newest formed world, or the newest
    attempt if started since, unless this rank's previous process had checked in under that one: it
    died while the attempt formed, so it cannot form (the others may hold the dead process's address),
    and the next one is joined."""
    formed = int(await_key(store, FORMED, time.monotonic() + timeout, "cannot rejoin the world: no world has formed "
                           "yet to rejoin"))
    newest = int(store.get(ATTEMPT))
    if newest > formed and store.check([_member(newest, rank)]):
        return next_attempt(store, newest)
    return next_attempt(store, formed)


def check_in(store: KeyStore, attempt: int, rank: int, *, fresh: bool) -> None:
    """Say that this process joins ``attempt`` as ``rank``: ``fresh`` if it was (re)started for it,
    not a survivor of the last generation."""
    store.set(_member(attempt, rank), "fresh" if fresh else "survivor")
    if fresh:  # one key survivors can poll cheaply, whatever the world's size (newcomer_waiting)
        store.set(f"popmesh/gen/{attempt}/fresh", "1")


def newcomer_waiting(store: KeyStore, generation: int) -> bool:
    """Whether a restarted process is waiting to join a generation after ``generation``: survivors that
    train on without it poll this, and re-form only once it is there (two store reads, no wait)."""
    newest = int(store.get(ATTEMPT))
    return newest > generation and store.check([f"popmesh/gen/{newest}/fresh"])


def restarted_ranks(store: KeyStore, generation: int, size: int) -> frozenset[int]:
    """The ranks whose restarted process waits to join a generation after ``generation``: their process
    in ``generation`` is gone, whatever its heartbeat peers have heard (the launcher restarts a rank
    only once it died)."""
    newest = int(store.get(ATTEMPT))
    if newest <= generation or not store.check([f"popmesh/gen/{newest}/fresh"]):
        return frozenset()
    keys = [_member(newest, r) for r in range(size)]
    present = [r for r in range(size) if store.check([keys[r]])]
    values = store.multi_get([keys[r] for r in present]) if present else []
    return frozenset(r for r, value in zip(present, values) if bytes(value) == b"fresh")


def await_members(store: KeyStore, attempt: int, size: int, deadline: float) -> None:
    """Return once every rank has checked in under ``attempt``; :class:`Superseded` as soon as a newer
    attempt starts; CommTimeout at ``deadline`` naming the ranks that never checked in."""
    _await_all(store, attempt, [_member(attempt, r) for r in range(size)], deadline,
               "never joined generation {attempt} (was the lost rank restarted? popmesh launch --max-restarts N)")


def mark_up(store: KeyStore, attempt: int, rank: int) -> None:
    """Say that ``rank``'s process group of ``attempt`` formed (its init returned)."""
    store.set(f"popmesh/gen/{attempt}/up/{rank}", "1")


def await_up(store: KeyStore, attempt: int, size: int, deadline: float) -> None:
    """Return once every rank's process group of ``attempt`` is up (:func:`mark_up`); :class:`Superseded`
    as soon as a newer attempt starts (a member died while the group formed and was restarted, or a rank
    gave up on this one); CommTimeout at ``deadline`` naming the ranks whose group never came up."""
    _await_all(store, attempt, [f"popmesh/gen/{attempt}/up/{r}" for r in range(size)], deadline,
               "joined generation {attempt} but never finished forming it (did they die while it formed?)")


def _await_all(store: KeyStore, attempt: int, keys: list[str], deadline: float, missing_said: str) -> None:
    """Return once every one of ``keys`` (one per rank) is set; Superseded or CommTimeout as above."""

    def superseded() -> None:
        newest = int(store.get(ATTEMPT))
        if newest > attempt and not store.check(keys):  # the last key may have come meanwhile: then it formed
            raise Superseded(attempt, newest)

    def timed_out() -> CommTimeout:
        missing = tuple(r for r, key in enumerate(keys) if not store.check([key]))
        return CommTimeout(f"the world did not re-form: rank(s) {list(missing)} "
                           + missing_said.format(attempt=attempt), missing)

    poll_store(lambda: store.check(keys), deadline, timed_out, meanwhile=superseded)


def poll_store(done: Callable[[], bool], deadline: float, timed_out: Callable[[], Exception], *,
               meanwhile: Callable[[], None] | None = None, max_pause: float = 0.1) -> None:
    """Return once ``done()``; between polls run ``meanwhile()`` (it raises to stop waiting for another
    reason), and raise ``timed_out()`` at ``deadline``. The pause doubles from 5 ms to ``max_pause``: a
    key set at once is seen at once, and a long wait asks the store little."""
    pause = 0.005
    while not done():
        if meanwhile is not None:
            meanwhile()
        if time.monotonic() >= deadline:
            raise timed_out()
        time.sleep(pause)
        pause = min(2 * pause, max_pause)


def _member(attempt: int, rank: int) -> str:
    return f"popmesh/gen/{attempt}/member/{rank}"


def mark_formed(store: KeyStore, attempt: int) -> None:
    """Record that ``attempt`` formed a world (restarted processes join the one after it)."""
    store.set(FORMED, str(attempt))


def newcomers(store: KeyStore, attempt: int, size: int) -> tuple[int, ...]:
    """The ranks that joined ``attempt`` as fresh processes (restarted, not survivors)."""
    found = store.multi_get([f"popmesh/gen/{attempt}/member/{r}" for r in range(size)])
    return tuple(r for r, value in enumerate(found) if bytes(value) == b"fresh")


def await_key(store: Any, key: str, deadline: float, failure: str) -> str:
    """The text under ``key`` once it is set; CommTimeout saying ``failure`` at ``deadline``."""
    poll_store(lambda: bool(store.check([key])), deadline, lambda: CommTimeout(failure, None))
    return bytes(store.get(key)).decode()
