"""Shared experience: each agent of a population sends its latest rollout to every other member, and
learns from theirs as well as its own, with a behaviour-corrected loss (SEAC's idea, Christianos et
al. 2020; PBRL shares a replay buffer the same way). A population that selects among agents which
also learn from each other's samples needs fewer environment steps than one whose agents learn
apart, as Ray Tune's trials must.

Nobody waits: a rollout goes out as point-to-point messages (a dict of arrays, no pickle), at most
one in flight to each peer (a peer still taking the last one skips this one), and :meth:`take`
returns the rollouts that have arrived since the last call, no older than ``max_age`` iterations and
at most one per peer's worth, the newest first: an agent ahead of the others takes what came (keeping
only the newest of each sender, within 2 iterations, starved the fastest agent), and one that fell
behind does not train on a backlog that would hold it back further. A peer that fails is dropped; a
re-formed world starts over with its new ranks. Which rollouts are taken is the pure :func:`fresh`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from popmesh.comm import messages
from popmesh.comm.messages import INTERNAL_TAG_BASE, POPULATION_TAGS, RecvHandle, SendHandle
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError, PopmeshError

__all__ = ["SHARING_TAG", "SampleSharing", "fresh"]

SHARING_TAG = messages.internal_tag(POPULATION_TAGS.stop - 1 - INTERNAL_TAG_BASE)  # past the policies' channels
_ITERATION = "__iteration__"  # the key that carries the sender's iteration in each message


def fresh(arrived: Iterable[tuple[int, int, Any]], iteration: int, max_age: int,
          limit: int | None = None) -> list[tuple[int, int, Any]]:
    """The rollouts among ``arrived`` (``(sender, its iteration, rollout)``, in arrival order) made at most
    ``max_age`` iterations before ``iteration``, the newest ``limit`` of them (None: all), in the order
    they came. Pure."""
    kept = [item for item in arrived if item[1] >= iteration - max_age]
    if limit is not None and len(kept) > limit:
        newest = sorted(range(len(kept)), key=lambda i: (-kept[i][1], -i))[:limit]
        kept = [kept[i] for i in sorted(newest)]
    return kept


class SampleSharing:
    """Every member's rollouts, for every other member of ``group`` (default: the world).

    Call :meth:`publish` once per iteration with this agent's rollout (a dict of str to numpy arrays),
    and :meth:`take` before training for the others' (or :meth:`exchange` for both). ``max_age``: how
    many iterations older than this agent's a rollout may be and still be used (asynchronous agents run
    apart; 0: only rollouts of the same iteration or later; the learner corrects for the older policies,
    as the demo's V-trace does). Close it before the world finalizes (or use it as a context manager).
    ``sent``, ``skipped`` (a peer still taking the last one) and ``received`` count rollouts."""

    def __init__(self, group: Comm | None = None, *, max_age: int = 8, limit: int | None = None,
                 tag: int = SHARING_TAG, timeout: float | None = None) -> None:
        if isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 0:
            raise ConfigError(f"SampleSharing(max_age={max_age!r}): give how many iterations older a rollout may be, "
                              "an int of 0 or more")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"SampleSharing(limit={limit!r}): give the most rollouts one take() returns, an int of "
                              "1 or more (None: one per peer)")
        self.limit = limit
        self.comm = resolve_group(group)
        if not self.comm.is_member:
            raise ConfigError("SampleSharing: this rank is not a member of the group it would share samples in")
        self.max_age, self.tag, self.timeout = max_age, tag, timeout
        self.sent = self.skipped = self.received = 0
        self._start()

    def _start(self) -> None:
        """Peers, sends and the standing receive of the world's current generation (a re-formed world has new
        ones: its ranks may be renumbered, and the old generation's receive is gone)."""
        self._generation = self.comm.world.generation
        self.peers = [r for r in self.comm.ranks if r != self.comm.world.rank]
        self._sending: dict[int, SendHandle] = {}
        self._lost: set[int] = set()
        self._standing: RecvHandle | None = messages.irecv(None, self.tag, group=self.comm) if self.peers else None

    def publish(self, rollout: Mapping[str, np.ndarray], iteration: int) -> None:
        """Send ``rollout`` (made at ``iteration``) to every peer that has taken the last one; never waits."""
        if _ITERATION in rollout:
            raise ConfigError(f"SampleSharing.publish: {_ITERATION!r} is the key this class sends the iteration under; "
                              "rename that entry of the rollout")
        if self.comm.world.generation != self._generation:
            self._start()
        payload = {**{name: np.require(value, requirements="C") for name, value in rollout.items()},
                   _ITERATION: np.array(iteration, np.int64)}
        for peer in self.peers:
            if peer in self._lost or not self._free(peer):
                self.skipped += peer not in self._lost
                continue
            try:
                self._sending[peer] = messages.isend(payload, peer, self.tag, group=self.comm, timeout=self.timeout)
                self.sent += 1
            except PopmeshError:
                self._lose(peer)

    def take(self, iteration: int) -> list[Any]:
        """The other members' rollouts that arrived since the last call, made at most ``max_age`` iterations
        before ``iteration``, the newest ``limit`` of them (default: as many as there are peers, so an agent
        that fell behind trains no longer than the others), in the order they came; the rest are dropped."""
        if self.comm.world.generation != self._generation:
            self._start()
        self._standing, arrived = messages.take_arrived(self._standing, self.tag)
        self.received += len(arrived)
        made = [(sender, int(payload.pop(_ITERATION)), payload) for sender, payload in arrived]
        kept = fresh(made, iteration, self.max_age, len(self.peers) if self.limit is None else self.limit)
        return [rollout for _, _, rollout in kept]

    def exchange(self, rollout: Mapping[str, np.ndarray], iteration: int) -> list[Any]:
        """:meth:`publish` this agent's ``rollout``, then :meth:`take` the others' (what a training loop calls
        once per iteration, between collecting and training)."""
        self.publish(rollout, iteration)
        return self.take(iteration)

    def close(self) -> None:
        """Stop receiving, and give the sends in flight a moment (a peer that ended does not hold this up)."""
        self._standing = None
        for handle in self._sending.values():
            try:
                handle.wait(1.0)
            except PopmeshError:
                pass
        self._sending.clear()

    def __enter__(self) -> SampleSharing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _free(self, peer: int) -> bool:
        """Whether ``peer`` took the last rollout sent to it (or none is in flight)."""
        handle = self._sending.get(peer)
        if handle is None:
            return True
        try:
            done = handle.done()
        except PopmeshError:
            self._lose(peer)
            return False
        if done:
            del self._sending[peer]
        return done

    def _lose(self, peer: int) -> None:
        self._lost.add(peer)
        self._sending.pop(peer, None)
