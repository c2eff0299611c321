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

Each attempt has a *roster*: the launcher's slot (its ``RANK``) of every member, in rank order. The
first world's is ``0..size-1``. The first rank to ask for an attempt's roster sets it, by compare-and-set,
from the last formed world's: its members less the slots marked *left* (lost for good: their launcher
had no restart left, ``popmesh launch --nnodes MIN:MAX``), then the slots of newly joined processes (a
launcher started later, its ``--node-rank`` past MIN), lowest first. So a world grows with its ranks'
numbers kept, and shrinks with the ranks above a lost one moved down. A rank whose slot a roster left
out (it registered after the roster was set) waits for that attempt to settle, then starts the next; an
attempt waiting for a slot that is then marked left is superseded by the next, formed without it.

The logic is over a small store interface (``set``, ``get``, ``check``, ``compare_set``,
``multi_get``, ``add``) so that it is tested with an in-memory store, without processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from popmesh.core.errors import CommTimeout, ConfigError
from popmesh.core.version import __version__

__all__ = ["ATTEMPT", "FORMED", "KeyStore", "Superseded", "prefix", "start_counting", "next_attempt",
           "newcomer_attempt", "check_in", "await_members", "mark_up", "await_up", "mark_formed", "newcomers",
           "newcomer_waiting", "restarted_ranks", "await_key", "poll_store", "roster", "agree_roster",
           "register_joiner", "refuse_joiner", "await_node", "joiners", "mark_left", "has_left", "left_count",
           "nodes_of"]

ATTEMPT = "popmesh/attempt"
FORMED = "popmesh/formed"


class KeyStore(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def add(self, key: str, amount: int) -> int: ...


class Superseded(Exception):
    """The attempt a rank waited in was replaced by a newer one (a rank failed while it formed)."""

    def __init__(self, attempt: int, newer: int) -> None:
        super().__init__(f"attempt {attempt} was superseded by attempt {newer}")
        self.attempt, self.newer = attempt, newer


def prefix(attempt: int) -> str:
    """The key prefix of a re-formed attempt's process group (the first world uses the store as it is)."""
    return f"popmesh/gen/{attempt}/pg"


def start_counting(store: KeyStore, size: int, per_node: int | None = None, fingerprint: str | None = None) -> None:
    """Create the counters and the roster of the first world of ``size`` ranks, ``per_node`` on each node,
    and what a joiner must match (its ``fingerprint``); every rank may call it, only the first call sets them."""
    store.compare_set(_roster_key(0), "", _text(range(size)))
    store.compare_set(_VERSION, "", __version__)
    if per_node:
        store.compare_set(_PER_NODE, "", str(per_node))
    if fingerprint:
        store.compare_set(_FINGERPRINT, "", fingerprint)
    store.compare_set(ATTEMPT, "", "0")


def roster(store: KeyStore, attempt: int) -> tuple[int, ...]:
    """The slots of ``attempt``'s members, in rank order (its roster must be set)."""
    return _slots(bytes(store.get(_roster_key(attempt))).decode())


def agree_roster(store: KeyStore, attempt: int) -> tuple[int, ...]:
    """``attempt``'s roster: the one set already, else this rank's proposal (the last formed world's
    members less those that left, then the joined slots not in it, lowest first)."""
    key = _roster_key(attempt)
    if store.check([key]):
        return roster(store, attempt)
    base = roster(store, int(store.get(FORMED)))
    kept = [slot for slot in base if not has_left(store, slot)]
    fresh = sorted({slot for slot in joiners(store) if slot not in base and not has_left(store, slot)})
    return _slots(bytes(store.compare_set(key, "", _text(kept + fresh))).decode())


def refuse_joiner(store: KeyStore, slot: int, per_node: int | None = None, fingerprint: str | None = None) -> None:
    """ConfigError for a process that would join a formed world where it cannot: its launcher starts
    another number of ranks than the world's nodes (``per_node``: the launchers' numbering would overlap),
    its slot is in the world already (another launcher runs its node), its popmesh is another version
    than the world's, or its ``fingerprint`` (``popmesh.init(fingerprint=...)``, a model's architecture)
    is not the world's. Checked before it registers: the running world never sees it."""
    theirs_model = _stored(store, _FINGERPRINT)
    if fingerprint and theirs_model and fingerprint != theirs_model:
        raise ConfigError(f"this process's model ({fingerprint}) is not the running world's ({theirs_model}): a "
                          "newcomer takes the others' state, so it must build the same model; start it with the "
                          "world's script and options")
    theirs_per_node = int(_stored(store, _PER_NODE) or 0)
    if per_node and theirs_per_node and per_node != theirs_per_node:
        raise ConfigError(f"this launcher starts {per_node} rank(s) (-n {per_node}), the running world's nodes "
                          f"{theirs_per_node} each: every launcher of an elastic world starts the same number of ranks "
                          f"(-n {theirs_per_node})")
    if slot in roster(store, int(store.get(FORMED))):
        raise ConfigError(f"rank {slot} of the launchers' numbering is in the running world already: another "
                          "popmesh launch runs this --node-rank; give a node rank no launcher uses (MIN to MAX-1)")
    theirs = _stored(store, _VERSION) or __version__
    if theirs != __version__:
        raise ConfigError(f"this process runs popmesh {__version__}, the running world popmesh {theirs}: join with "
                          "the same version (pip install popmesh==" + theirs + ")")


def register_joiner(store: KeyStore, slot: int) -> None:
    """Say that a new process for ``slot`` waits to join the world (a launcher started later)."""
    index = store.add(_JOINS, 1)
    store.set(f"{_JOINS}/{index}", str(slot))


def await_node(store: KeyStore, slot: int, per_node: int, deadline: float) -> None:
    """Return once every rank of ``slot``'s node (``per_node`` of them) has registered to join, so that a
    launcher's ranks join the world together, in one re-form; CommTimeout at ``deadline``."""
    first = slot - slot % per_node
    mine = set(range(first, first + per_node))

    def timed_out() -> CommTimeout:
        missing = sorted(mine - set(joiners(store)))
        return CommTimeout(f"rank(s) {missing} of this launcher never registered to join the world", tuple(missing))

    poll_store(lambda: mine <= set(joiners(store)), deadline, timed_out)


def joiners(store: KeyStore) -> list[int]:
    """The slots of every process that registered to join, in the order they did."""
    count = store.add(_JOINS, 0)
    return [int(bytes(v)) for v in store.multi_get([f"{_JOINS}/{i}" for i in range(1, count + 1)])] if count else []


def mark_left(store: KeyStore, slot: int) -> None:
    """Say that ``slot`` is lost for good: no process will take it again, and the next roster leaves it out."""
    store.set(f"{_LEFT}/{slot}", "1")
    store.add(_LEFT_COUNT, 1)


def left_count(store: KeyStore) -> int:
    """How many slots were ever marked left (one read): a generation that saw fewer has one to re-form without."""
    return store.add(_LEFT_COUNT, 0)


def has_left(store: KeyStore, slot: int) -> bool:
    return store.check([f"{_LEFT}/{slot}"])


def nodes_of(slots: tuple[int, ...], per_node: int) -> tuple[int, ...]:
    """The nodes (node ranks) that ``slots`` are on, each once, when every node runs ``per_node`` ranks. Pure."""
    return tuple(sorted({slot // per_node for slot in slots}))


_JOINS = "popmesh/joins"
_VERSION = "popmesh/version"
_PER_NODE = "popmesh/per_node"
_FINGERPRINT = "popmesh/fingerprint"
_LEFT = "popmesh/left"
_LEFT_COUNT = "popmesh/left_count"


def _stored(store: KeyStore, key: str) -> str | None:
    """The text under ``key``, or None where it was never set (no wait)."""
    return bytes(store.get(key)).decode() if store.check([key]) else None


def _roster_key(attempt: int) -> str:
    return f"popmesh/gen/{attempt}/roster"


def _text(slots: Any) -> str:
    return ",".join(str(int(slot)) for slot in slots)


def _slots(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


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


def check_in(store: KeyStore, attempt: int, slot: int, *, fresh: bool) -> None:
    """Say that this process joins ``attempt`` in ``slot``: ``fresh`` if it was (re)started or newly
    started for it, not a survivor of the last generation."""
    store.set(_member(attempt, slot), "fresh" if fresh else "survivor")
    if fresh:  # one key survivors can poll cheaply, whatever the world's size (newcomer_waiting)
        store.set(f"popmesh/gen/{attempt}/fresh", "1")


def newcomer_waiting(store: KeyStore, generation: int) -> bool:
    """Whether a restarted process is waiting to join a generation after ``generation``: survivors that
    train on without it poll this, and re-form only once it is there (two store reads, no wait)."""
    newest = int(store.get(ATTEMPT))
    return newest > generation and store.check([f"popmesh/gen/{newest}/fresh"])


def restarted_ranks(store: KeyStore, generation: int, members: tuple[int, ...]) -> frozenset[int]:
    """The ranks of ``generation`` (whose roster is ``members``) whose restarted process waits to join a
    later one, or whose slot was marked left: their process in ``generation`` is gone, whatever its
    heartbeat peers have heard (the launcher restarts a rank, or marks it left, only once it died)."""
    gone = {rank for rank, slot in enumerate(members) if has_left(store, slot)} if left_count(store) else set()
    newest = int(store.get(ATTEMPT))
    if newest <= generation or not store.check([f"popmesh/gen/{newest}/fresh"]):
        return frozenset(gone)
    keys = [_member(newest, slot) for slot in members]
    present = [r for r in range(len(members)) if store.check([keys[r]])]
    values = store.multi_get([keys[r] for r in present]) if present else []
    return frozenset(gone | {r for r, value in zip(present, values) if bytes(value) == b"fresh"})


def await_members(store: KeyStore, attempt: int, members: tuple[int, ...], deadline: float) -> None:
    """Return once every slot of ``members`` has checked in under ``attempt``; :class:`Superseded` as soon
    as a newer attempt starts, or a slot that has not checked in is marked left (the next attempt is
    started then, to form without it); CommTimeout at ``deadline`` naming the ranks that never checked in."""
    keys = [_member(attempt, slot) for slot in members]

    def left_meanwhile() -> None:
        if any(has_left(store, slot) for slot, key in zip(members, keys) if not store.check([key])):
            newer = next_attempt(store, attempt)
            if newer > attempt:
                raise Superseded(attempt, newer)

    _await_all(store, attempt, keys, deadline,
               "never joined generation {attempt} (was the lost rank restarted? popmesh launch --max-restarts N; "
               "or, to go on without it, --nnodes MIN:MAX)", also=left_meanwhile)


def mark_up(store: KeyStore, attempt: int, rank: int) -> None:
    """Say that ``rank``'s process group of ``attempt`` formed (its init returned)."""
    store.set(f"popmesh/gen/{attempt}/up/{rank}", "1")


def await_up(store: KeyStore, attempt: int, members: tuple[int, ...], deadline: float) -> None:
    """Return once every rank's process group of ``attempt`` is up (:func:`mark_up`); :class:`Superseded`
    as soon as a newer attempt starts (a member died while the group formed and was restarted, or a rank
    gave up on this one); CommTimeout at ``deadline`` naming the ranks whose group never came up."""
    _await_all(store, attempt, [f"popmesh/gen/{attempt}/up/{slot}" for slot in members], deadline,
               "joined generation {attempt} but never finished forming it (did they die while it formed?)")


def _await_all(store: KeyStore, attempt: int, keys: list[str], deadline: float, missing_said: str, *,
               also: Callable[[], None] | None = None) -> None:
    """Return once every one of ``keys`` (one per rank) is set; Superseded or CommTimeout as above;
    ``also`` runs between polls too (it raises Superseded for a reason of its own)."""

    def superseded() -> None:
        newest = int(store.get(ATTEMPT))
        if newest > attempt and not store.check(keys):  # the last key may have come meanwhile: then it formed
            raise Superseded(attempt, newest)
        if also is not None:
            also()

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


def _member(attempt: int, slot: int) -> str:
    return f"popmesh/gen/{attempt}/member/{slot}"


def mark_formed(store: KeyStore, attempt: int) -> None:
    """Record that ``attempt`` formed a world (restarted processes join the one after it)."""
    store.set(FORMED, str(attempt))


def newcomers(store: KeyStore, attempt: int, members: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks that joined ``attempt`` (whose roster is ``members``) as fresh processes: restarted or
    newly joined, not survivors."""
    found = store.multi_get([_member(attempt, slot) for slot in members])
    return tuple(r for r, value in enumerate(found) if bytes(value) == b"fresh")


def await_key(store: Any, key: str, deadline: float, failure: str) -> str:
    """The text under ``key`` once it is set; CommTimeout saying ``failure`` at ``deadline``."""
    poll_store(lambda: bool(store.check([key])), deadline, lambda: CommTimeout(failure, None))
    return bytes(store.get(key)).decode()
