"""The coordinator side of the asynchronous policy: collect reports, decide, dispatch, say FIN.

What to decide and when is its :class:`~popmesh.population.mechanisms.asynchronous.deciders.Decider`'s
(each report judged as it arrives, or every iteration once complete); this side moves the messages.

Runs inside a trainer's background thread (the group's first rank by default) or in the calling
thread of a dedicated coordinator rank (:meth:`AsyncSelectiveAveraging.coordinate`). Like the
trainer side it only polls, and only uses :mod:`popmesh.comm.messages` on internal tags. A decision for
its own rank is handed to that rank's trainer side directly (``local``), not sent to itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from popmesh.comm.messages import RecvHandle, irecv, isend
from popmesh.comm.world import World
from popmesh.core.errors import CommTimeout, PeerFailure
from popmesh.population.mechanisms.asynchronous.deciders import Decider, Dispatch
from popmesh.population.mechanisms.asynchronous.protocol import Channels, parse_up
from popmesh.population.mechanisms.asynchronous.trainer import reap

__all__ = ["CoordinatorLink"]


class CoordinatorLink:
    """Coordinate the training ranks ``ranks`` (global, group order) from global rank ``world.rank``."""

    def __init__(self, world: World, ranks: Sequence[int], tags: Channels, decider: Decider,
                 timeout: float, local: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.world, self.ranks, self.tags, self.decider = world, list(ranks), tags, decider
        self._local = local  # this rank's trainer side, when the coordinator also trains
        self.timeout = timeout
        self._up: RecvHandle | None = irecv(self.ranks, tags.up, group=world)
        self._sends: list[Any] = []
        self._dispatched_at = 0.0
        self.decisions = 0
        self.finished = False

    def poll(self) -> bool:
        """Take every up message that arrived, send the decisions they make ready, FIN at the end."""
        failure = self.world.failure(self.ranks)
        if failure is not None:  # a member the heartbeat found frozen or dead: no decision can complete
            raise failure
        self._sends = reap(self._sends, self.timeout)  # a completed send is no progress: nothing follows
        progress = False
        while self._up is not None and self._up.done():
            src, row = self._up.wait()
            self._up = irecv(self.ranks, self.tags.up, group=self.world)
            self.decider.record(self.ranks.index(src), parse_up(row), time.monotonic())
            progress = True
        for dispatch in self.decider.ready():  # after the batch: the complete protocol decides its newest iteration
            self._dispatch(dispatch)
            progress = True
        if not self.finished and self.decider.finished():
            for dst in self.ranks:
                self._tell({"kind": "fin"}, dst)
            self.finished = True
            progress = True
        self._check_liveness()
        return progress

    def _dispatch(self, dispatch: Dispatch) -> None:
        for g, message in dispatch.messages.items():
            self._tell(message, self.ranks[g])
        if dispatch.replaced:  # not a round's notice
            self._dispatched_at = time.monotonic()
            self.decisions += 1

    def _tell(self, message: dict[str, Any], dst: int) -> None:
        """Send ``message`` down to global rank ``dst``, or hand it over when that is this rank."""
        if dst == self.world.rank and self._local is not None:
            self._local(message)
        else:
            self._sends.append(isend(message, dst, self.tags.down, group=self.world))

    def _check_liveness(self) -> None:
        now = time.monotonic()
        stalled = self.decider.stalled(now, self.timeout)
        if stalled is not None:
            it, missing = stalled
            self._raise_missing([self.ranks[r] for r in missing],
                                f"ranks {[self.ranks[r] for r in missing]} sent no metric for iteration {it} "
                                f"within {self.timeout:g} s while the others did")
        acks = self.decider.missing_acks()
        if acks and now - self._dispatched_at > 2 * self.timeout:
            late = [self.ranks[r] for r in acks]
            self._raise_missing(late, f"replaced ranks {late} did not finish their replacement within "
                                      f"{2 * self.timeout:g} s")

    def _raise_missing(self, ranks: list[int], what: str) -> None:
        probe = irecv(ranks, self.tags.up, group=self.world)
        try:
            probe.wait(0.05)  # the engine names dead ranks (PeerFailure) when it can tell
        except PeerFailure as e:
            raise PeerFailure(f"population coordinator: {what}; {e}", e.ranks) from e
        except CommTimeout:
            pass
        raise CommTimeout(f"population coordinator: {what}. Did they die, or do they call the policy with "
                          "other iterations?", tuple(ranks))

    def missing_byes(self) -> list[int]:
        """Global ranks that have not said BYE yet."""
        return [g for i, g in enumerate(self.ranks) if i not in self.decider.byes]

    def check_shutdown(self, since: float, timeout: float) -> None:
        """Raise if the trainers have not all said BYE within ``timeout`` seconds of ``since``."""
        if not self.finished and time.monotonic() - since > timeout:
            missing = self.missing_byes()
            if missing:
                self._raise_missing(missing, f"ranks {missing} did not shut the policy down within {timeout:g} s")
            late = [self.ranks[r] for r in self.decider.missing_acks()]
            raise CommTimeout(f"population coordinator: replaced ranks {late} did not finish their replacement "
                              f"within {timeout:g} s of shutdown", tuple(late))

    def abort(self, reason: str, lost: tuple[int, ...] = ()) -> None:
        """Tell every trainer that coordination stopped (best effort, no waiting); ``lost``: the ranks
        whose failure stopped it, if known, so the trainers' errors name them."""
        for dst in self.ranks:
            if dst == self.world.rank and self._local is not None:
                continue  # this rank's trainer side fails with the coordinator, in the same thread
            try:
                isend({"kind": "abort", "reason": reason, "lost": list(lost)}, dst, self.tags.down, group=self.world)
            except Exception:
                pass

    def drain(self, timeout: float) -> None:
        """Wait for every send in flight to complete."""
        for handle in self._sends:
            handle.wait(timeout)
        self._sends = []

    def close(self) -> None:
        """Withdraw the posted receive."""
        self._up = None
