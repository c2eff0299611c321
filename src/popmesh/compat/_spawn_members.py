"""Who takes part in the spawn_policy facade's asynchronous policy: torchgfn's ``coordinator_group_rank``
and ``participant_group_ranks``, mapped onto :class:`popmesh.population.AsyncSelectiveAveraging`.

Both are group ranks of the ``group`` passed to the policy's call. The participants report and take part
in replacement; popmesh's policy runs over them alone (:func:`participants`: their ranks as a group that
carries the policy's point-to-point messages, the only traffic of the asynchronous policy). The
coordinator decides: popmesh's ``coordinator`` (a global rank); one outside the participants serves them
from a thread of its own (:class:`Serving`), as its torchgfn counterpart does from its background thread.
"""

from __future__ import annotations

import numbers
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from popmesh.comm.world import Comm
from popmesh.core.errors import CommTimeout, ConfigError, PopmeshError
from popmesh.engines import GroupSpec
from popmesh.population import AsyncSelectiveAveraging

__all__ = ["Members", "Membership", "check_arguments", "members_of", "participants", "Serving"]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_arguments(coordinator_group_rank: object,
                    participant_group_ranks: object) -> tuple[int, tuple[int, ...] | None]:
    """What can be checked without the group: ints >= 0 and a non-empty list. The coordinator's group rank,
    and the participants' deduplicated and sorted as torchgfn does (None: every rank of the group)."""
    if not _is_int(coordinator_group_rank) or int(coordinator_group_rank) < 0:
        raise ConfigError(f"coordinator_group_rank must be a group rank (an int >= 0), got {coordinator_group_rank!r}")
    if participant_group_ranks is None:
        return int(coordinator_group_rank), None
    if isinstance(participant_group_ranks, (str, bytes)) or not isinstance(participant_group_ranks, Sequence) \
            or not all(_is_int(r) and r >= 0 for r in participant_group_ranks):
        raise ConfigError(f"participant_group_ranks must be a list of group ranks (ints >= 0) or None, got "
                          f"{participant_group_ranks!r}")
    if not participant_group_ranks:
        raise ConfigError("participant_group_ranks is empty: name at least one group rank, or pass None for all")
    return int(coordinator_group_rank), tuple(sorted({int(r) for r in participant_group_ranks}))


@dataclass(frozen=True)
class Members:
    """The participants' and the coordinator's global ranks within one group."""

    participants: tuple[int, ...]
    coordinator: int

    @property
    def coordinator_participates(self) -> bool:
        return self.coordinator in self.participants


def members_of(comm: Comm, coordinator_group_rank: int, participants: tuple[int, ...] | None) -> Members:
    """The group ranks turned into global ranks of ``comm``; ConfigError naming the argument and the group's
    size where one is not a rank of it."""
    size = comm.size
    if coordinator_group_rank >= size:
        raise ConfigError(f"coordinator_group_rank={coordinator_group_rank} is not a rank of the group of {size} "
                          f"passed to the call (group ranks 0..{size - 1})")
    outside = [r for r in participants or () if r >= size]
    if outside:
        raise ConfigError(f"participant_group_ranks has {outside}, not ranks of the group of {size} passed to the call "
                          f"(group ranks 0..{size - 1})")
    chosen = range(size) if participants is None else participants
    return Members(tuple(comm.ranks[r] for r in chosen), comm.ranks[coordinator_group_rank])


def participants(comm: Comm, members: Members) -> Comm:
    """``comm`` itself when everyone takes part, else the participants' ranks as a group for the asynchronous
    policy's messages (no collective runs on it, so it needs no group of the engine's own: making one would
    be collective over the whole world)."""
    if members.participants == tuple(comm.ranks):
        return comm
    handle = comm.handle if comm.rank in members.participants else None
    return Comm(comm.world, GroupSpec(-1, members.participants), handle)


class Serving:
    """A coordinator outside the participants: ``policy.coordinate(group)`` on a thread of its own, until
    every participant has shut its policy down."""

    def __init__(self, policy: AsyncSelectiveAveraging, group: Comm) -> None:
        self.error: BaseException | None = None
        self.decisions = 0
        self._thread = threading.Thread(target=self._run, args=(policy, group), daemon=True,
                                        name=f"popmesh-spawn-coordinator-{group.rank}")
        self._thread.start()

    def _run(self, policy: AsyncSelectiveAveraging, group: Comm) -> None:
        try:
            self.decisions = policy.coordinate(group)
        except BaseException as e:  # raised by the caller's next call, or at shutdown
            self.error = e

    def surface(self) -> None:
        """Raise what the coordinator's thread met, if anything."""
        if self.error is None:
            return
        if isinstance(self.error, PopmeshError):
            raise self.error
        raise PopmeshError(f"the spawn policy's coordinator thread failed: {type(self.error).__name__}: "
                           f"{self.error}") from self.error

    def join(self, timeout: float, waiting_for: Sequence[int]) -> None:
        """Wait for the participants' goodbyes; CommTimeout naming them after ``timeout`` seconds."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CommTimeout(f"the spawn policy's coordinator still serves participants {list(waiting_for)} after "
                              f"{timeout:g} s: every participant must call shutdown()", tuple(waiting_for))
        self.surface()


class Membership:
    """A policy's members in the group of its calls, found at the first call (ConfigError if a later call
    passes a group with other members); starts :class:`Serving` on a coordinator outside the participants."""

    def __init__(self, coordinator_group_rank: object, participant_group_ranks: object,
                 num_training_ranks: int | None = None) -> None:
        self.coordinator_group_rank, self.chosen = check_arguments(coordinator_group_rank, participant_group_ranks)
        self.num_training_ranks = num_training_ranks
        self.group: Comm | None = None
        self.members: Members | None = None
        self.taking_part: Comm | None = None
        self.serving: Serving | None = None

    def resolve(self, comm: Comm, policy: AsyncSelectiveAveraging) -> tuple[Members, Comm]:
        """The members of ``comm`` and the participants' group; sets ``policy``'s coordinator."""
        if self.group is comm and self.members is not None and self.taking_part is not None:
            return self.members, self.taking_part
        members = members_of(comm, self.coordinator_group_rank, self.chosen)
        if self.members is not None and self.members != members:
            raise ConfigError(f"this policy works over the participants {list(self.members.participants)}; the call "
                              f"passed a group whose participants are {list(members.participants)}: create one policy "
                              "per group")
        if self.num_training_ranks is not None and self.num_training_ranks != len(members.participants):
            warnings.warn(f"num_training_ranks={self.num_training_ranks} is not the number of participants "
                          f"({len(members.participants)}), which is what counts (as in torchgfn)", stacklevel=4)
        self.num_training_ranks = len(members.participants)
        policy.coordinator = members.coordinator
        self.group, self.members, self.taking_part = comm, members, participants(comm, members)
        if self.serving is None and comm.rank == members.coordinator and not members.coordinator_participates \
                and len(members.participants) > 1:
            self.serving = Serving(policy, self.taking_part)
        return members, self.taking_part

    def shutdown(self, policy: AsyncSelectiveAveraging) -> None:
        """``policy``'s shutdown on this rank; a serving coordinator first waits for every participant's."""
        if self.members is None or self.taking_part is None:
            policy.shutdown()
            return
        if self.serving is not None:
            self.serving.join(self.taking_part.timeout, self.members.participants)
        policy.shutdown(group=self.taking_part)
