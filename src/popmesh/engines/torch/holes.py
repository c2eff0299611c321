"""Survivors of a lost rank agree on who is left, so they can work together before it rejoins.

While a lost rank's process restarts (seconds: a new interpreter importing torch), the survivors of
its generation can go on together in a group of their own (``world.survivors()``): a subgroup of the
generation's process group, formed by its members only, so no dead rank takes part. They must agree
on its members. Each survivor knows the ranks its heartbeat found failed, but not all at the same
moment, so *rounds* in the rendezvous store settle it, under the generation's prefix:

* ``.../hole/round``: the newest round anyone started, raised only by compare-and-set from a value
  its caller saw (survivors that start a round together land on the same one);
* ``.../hole/<n>/lost``: the lost ranks of round ``n``, set once, by whoever proposes first;
* ``.../hole/<n>/member/<rank>``: ``rank`` takes part in round ``n``.

A survivor proposes the ranks it knows lost in the newest round (the engine counts a rank whose
restarted process waits to join as lost too: its heartbeat is stopped while this runs). If the
round's agreed set lacks one of them (a loss the first proposer had not seen yet), it starts the
next round. Then every member checks in, and waits for the others: a waiting member moves to a
newer round as soon as one starts, and starts one itself when a member it waits for is found
failed meanwhile. Any round's lost set
holds every loss its proposer knew, so a later call (a second loss) never forms an older round again.

The logic is over the store interface of :mod:`popmesh.engines.torch.generations`, so it is tested
with an in-memory store, without processes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from popmesh.core.errors import CommTimeout, PeerFailure
from popmesh.engines.torch.generations import KeyStore, Superseded, poll_store

__all__ = ["agree_survivors", "newest_round", "next_round", "propose_lost", "encode_ranks", "decode_ranks"]

_PAUSE_MAX_S = 0.05


def _key(generation: int, name: str) -> str:
    return f"popmesh/gen/{generation}/hole/{name}"


def encode_ranks(ranks: Collection[int]) -> str:
    """``ranks`` as the store keeps them: sorted, comma-separated (never empty: a hole has a lost rank)."""
    return ",".join(str(r) for r in sorted(set(ranks)))


def decode_ranks(text: bytes | str) -> frozenset[int]:
    value = text.decode() if isinstance(text, bytes) else text
    return frozenset(int(r) for r in value.split(",") if r)


def newest_round(store: KeyStore, generation: int) -> int:
    """The newest round started in ``generation`` (0 when none was)."""
    return int(store.compare_set(_key(generation, "round"), "", "0"))


def next_round(store: KeyStore, generation: int, after: int) -> int:
    """The round to go to after ``after``: ``after + 1``, unless a newer one was started already."""
    return int(store.compare_set(_key(generation, "round"), str(after), str(after + 1)))


def propose_lost(store: KeyStore, generation: int, round_: int, lost: Collection[int]) -> frozenset[int]:
    """The lost ranks of ``round_``: ``lost`` if this is the first proposal, else the first one's."""
    return decode_ranks(store.compare_set(_key(generation, f"{round_}/lost"), "", encode_ranks(lost)))


class _MemberFailed(Exception):
    """A member of the round being formed was found failed before it checked in."""


def _await_round(store: KeyStore, generation: int, round_: int, members: tuple[int, ...], deadline: float,
                 failed: Callable[[], Collection[int]]) -> None:
    keys = [_key(generation, f"{round_}/member/{r}") for r in members]

    def moved_on() -> None:
        newest = newest_round(store, generation)
        if newest > round_:
            raise Superseded(round_, newest)
        if set(failed()) & set(members):
            raise _MemberFailed()

    def timed_out() -> CommTimeout:
        missing = [r for r, key in zip(members, keys) if not store.check([key])]
        return CommTimeout(f"the survivors of generation {generation} did not agree on their group: rank(s) "
                           f"{missing} never took part (each survivor calls world.survivors() after the loss)",
                           tuple(missing))

    poll_store(lambda: store.check(keys), deadline, timed_out, meanwhile=moved_on, max_pause=_PAUSE_MAX_S)


def agree_survivors(store: KeyStore, generation: int, rank: int, size: int,
                    failed: Callable[[], Collection[int]], deadline: float) -> tuple[tuple[int, ...], int]:
    """The survivors of ``generation`` (global ranks, ascending) that every one of them agreed on, and
    the round that settled it. ``failed()`` gives the ranks this rank knows lost (it may grow while
    this waits); it must name at least one. PeerFailure if the others count this rank as lost;
    CommTimeout at ``deadline`` naming the survivors that never took part."""
    round_ = newest_round(store, generation)
    while True:
        known = frozenset(failed())
        agreed = propose_lost(store, generation, round_, known)
        if rank in agreed:
            raise PeerFailure(f"the other survivors of generation {generation} found rank {rank} lost (its heartbeat "
                              "went silent): it cannot join their group; it should end, and be restarted", (rank,))
        if not known <= agreed:  # this rank knows of a loss the round's proposer had not seen: a new round
            round_ = next_round(store, generation, round_)
            continue
        members = tuple(r for r in range(size) if r not in agreed)
        store.set(_key(generation, f"{round_}/member/{rank}"), "1")
        try:
            _await_round(store, generation, round_, members, deadline, failed)
            return members, round_
        except Superseded as e:
            round_ = e.newer
        except _MemberFailed:
            round_ = next_round(store, generation, round_)
