"""Generations of a world that re-forms after a lost rank: which attempt to join, and when all are there.

A world that outlives one of its ranks forms again, with the rank's restarted process, under a new
*generation*: a fresh process group over the same rendezvous store, its keys under the prefix of the
attempt that formed it. Ranks agree on the attempt through two keys of the store:

* ``ATTEMPT``: the newest attempt anyone has started, only ever raised by compare-and-set from a value
  its caller saw, so ranks that start a new attempt at the same time land on the same one;
* ``FORMED``: the newest attempt that formed a world.

A survivor of generation ``g`` asks for ``g + 1`` (or whatever is newer); a restarted process asks for
one past ``FORMED``; a rank whose attempt failed (a rank died while it formed) asks for the next. An
attempt forms only once every rank has checked in under it (:func:`await_members`), which also lets
a waiting rank see that the attempt was superseded and move on instead of waiting out its timeout.

The logic is over a small store interface (``set``, ``get``, ``check``, ``compare_set``,
``multi_get``) so that it is tested with an in-memory store, without processes.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from popmesh.core.errors import CommTimeout

__all__ = ["ATTEMPT", "FORMED", "KeyStore", "Superseded", "prefix", "start_counting", "next_attempt",
           "newcomer_attempt", "check_in", "await_members", "mark_formed", "newcomers", "newcomer_waiting",
           "await_key"]

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


def newcomer_attempt(store: KeyStore, timeout: float) -> int:
    """The attempt a restarted process joins: one past the newest formed world (or newer, if started)."""
    formed = int(await_key(store, FORMED, time.monotonic() + timeout, "cannot rejoin the world: no world has formed "
                           "yet to rejoin"))
    return next_attempt(store, formed)


def check_in(store: KeyStore, attempt: int, rank: int, *, fresh: bool) -> None:
    """Say that this process joins ``attempt`` as ``rank``: ``fresh`` if it was (re)started for it,
    not a survivor of the last generation."""
    store.set(f"popmesh/gen/{attempt}/member/{rank}", "fresh" if fresh else "survivor")
    if fresh:  # one key survivors can poll cheaply, whatever the world's size (newcomer_waiting)
        store.set(f"popmesh/gen/{attempt}/fresh", "1")


def newcomer_waiting(store: KeyStore, generation: int) -> bool:
    """Whether a restarted process is waiting to join a generation after ``generation``: survivors that
    train on without it poll this, and re-form only once it is there (two store reads, no wait)."""
    newest = int(store.get(ATTEMPT))
    return newest > generation and store.check([f"popmesh/gen/{newest}/fresh"])


def await_members(store: KeyStore, attempt: int, size: int, deadline: float, pause: float = 0.005) -> None:
    """Return once every rank has checked in under ``attempt``; :class:`Superseded` as soon as a newer
    attempt starts; CommTimeout at ``deadline`` naming the ranks that never checked in."""
    keys = [f"popmesh/gen/{attempt}/member/{r}" for r in range(size)]
    while not store.check(keys):
        newest = int(store.get(ATTEMPT))
        if newest > attempt:
            raise Superseded(attempt, newest)
        if time.monotonic() >= deadline:
            missing = tuple(r for r, key in enumerate(keys) if not store.check([key]))
            raise CommTimeout(f"the world did not re-form: rank(s) {list(missing)} never joined generation "
                              f"{attempt} (was the lost rank restarted? popmesh launch --max-restarts N)", missing)
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def mark_formed(store: KeyStore, attempt: int) -> None:
    """Record that ``attempt`` formed a world (restarted processes join the one after it)."""
    store.set(FORMED, str(attempt))


def newcomers(store: KeyStore, attempt: int, size: int) -> tuple[int, ...]:
    """The ranks that joined ``attempt`` as fresh processes (restarted, not survivors)."""
    found = store.multi_get([f"popmesh/gen/{attempt}/member/{r}" for r in range(size)])
    return tuple(r for r, value in enumerate(found) if bytes(value) == b"fresh")


def await_key(store: Any, key: str, deadline: float, failure: str) -> str:
    """The text under ``key`` once it is set; CommTimeout saying ``failure`` at ``deadline``."""
    pause = 0.005
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise CommTimeout(failure, None)
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
    return bytes(store.get(key)).decode()
