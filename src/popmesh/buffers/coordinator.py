"""The coordinator of the replay-buffer service: population-wide discoveries and a global baseline.

Managers report the modes their scoring discovered (MODE_REPORT, with the training rank that found
them) and their local baselines (BASELINE_REPORT). The coordinator keeps the set of distinct modes,
counts first discoveries per training rank, combines the managers' latest baselines (``min`` by
default) into a global baseline and sends it to every manager still running (BASELINE_SYNC) when
it changes. Trainers ask for GET_POPULATION_STATS. The loop returns once every manager has sent
EXIT (each is answered with EXIT_ACK, after every BASELINE_SYNC sent to it). torchgfn left this loop
to downstream code; this is popmesh's version of it.

A lost rank does not end the loop: where the launcher restarts lost ranks the coordinator re-forms
the world and a restarted manager is coordinated again (its store starts empty); otherwise a lost
manager is logged by rank, dropped from the baseline and listed in ``lost_managers`` of the stats,
and the others are coordinated on. In an elastic world (``World.elastic``) it re-forms whenever the
world does (ranks join, or leave for good), keeping its modes and baselines under the ranks' new numbers.

Cross-rank contract: run :meth:`Coordinator.run` on the coordinator rank while the managers run;
trainers ask for population stats before they drain (the coordinator leaves after the managers).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from popmesh.buffers.baselines import reduce_baselines
from popmesh.buffers.protocol import (
    COORDINATOR_TAG,
    REQUEST_TAG,
    STATS_TAG,
    Message,
    MessageType,
    ProtocolError,
    from_payload,
)
from popmesh.buffers.service import (
    Outgoing,
    WorldChanging,
    moved_keys,
    moved_ranks,
    next_message,
    reform_service,
    send_outgoing,
)
from popmesh.comm import messages
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import CommTimeout, ConfigError, PeerFailure
from popmesh.core.timeouts import check_timeout, resolve_timeout

__all__ = ["Coordinator"]

logger = logging.getLogger(__name__)


class Coordinator:
    """Aggregates reports from the manager ranks ``managers`` (see the module docstring)."""

    def __init__(self, managers: Sequence[int], *, baseline_reduce: str = "min", group: Comm | None = None,
                 timeout: float | None = None) -> None:
        if not managers:
            raise ConfigError("a coordinator needs at least one buffer manager to coordinate")
        reduce_baselines([], baseline_reduce)  # validates the name
        self.managers = tuple(int(r) for r in managers)
        self.baseline_reduce, self.group = baseline_reduce, group
        self.timeout = None if timeout is None else check_timeout(timeout, what="Coordinator")
        self.modes: set[str] = set()
        self.modes_by_rank: Counter[int] = Counter()
        self.baselines: dict[int, float | None] = {}
        self.global_baseline: float | None = None
        self.exited: set[int] = set()
        self.lost: set[int] = set()  # managers lost for good (no restart to wait for)
        self.roles: Any = None  # the Roles it was made from, if any (rebuilt after a re-form)
        self.messages: Counter[str] = Counter()
        self.errors = 0

    @classmethod
    def from_context(cls, ctx: Any, **options: Any) -> Coordinator:
        """The coordinator, from the world's :class:`~popmesh.topology.roles.Roles` (run it on the coordinator rank)."""
        if not ctx.is_coordinator_rank():
            raise ConfigError(f"rank {ctx.my_rank} is not the coordinator (rank {ctx.coordinator_rank})")
        options.setdefault("group", ctx.world)
        coordinator = cls(list(ctx.layout.buffer_ranks), **options)
        coordinator.roles = ctx  # after a re-form its groups are made again (Roles.rebuild), as every rank does
        return coordinator

    @property
    def done(self) -> bool:
        """True once every manager has sent EXIT (or was lost, where lost ranks are not restarted)."""
        return self.exited | self.lost >= set(self.managers)

    def population_stats(self) -> dict[str, Any]:
        """Fields of a POPULATION_STATS reply."""
        return {"modes_found": len(self.modes), "modes_by_rank": {str(r): n for r, n in self.modes_by_rank.items()},
                "global_baseline": self.global_baseline,
                "manager_baselines": {str(r): b for r, b in self.baselines.items()},
                "active_managers": [r for r in self.managers if r not in self.exited | self.lost],
                "lost_managers": sorted(self.lost)}

    def handle(self, src: int, message: Message) -> list[Outgoing]:
        """Apply one message from global rank ``src``; returns the messages to send."""
        self.messages[message.type.value] += 1
        kind, from_manager = message.type, src in self.managers
        if kind is MessageType.GET_POPULATION_STATS:
            return [Outgoing(src, STATS_TAG, Message(MessageType.POPULATION_STATS, self.population_stats()))]
        if kind is MessageType.MODE_REPORT and from_manager:
            self._add_modes(message.data)
            return []
        if kind is MessageType.BASELINE_REPORT and from_manager:
            value = message.data.get("baseline")
            self.baselines[src] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
                else None
            return self._sync()
        if kind is MessageType.EXIT and from_manager:
            self.exited.add(src)
            return [Outgoing(src, REQUEST_TAG, Message(MessageType.EXIT_ACK))]  # after every sync to it
        return self._error(src, f"the coordinator does not handle {kind.value} from rank {src}")

    def _add_modes(self, data: dict[str, Any]) -> None:
        modes = [m for m in data.get("modes", []) if isinstance(m, str)]
        new = {m for m in modes if m not in self.modes}
        self.modes |= new
        if new and isinstance(data.get("training_rank"), int):
            self.modes_by_rank[data["training_rank"]] += len(new)

    def _sync(self) -> list[Outgoing]:
        value = reduce_baselines(list(self.baselines.values()), self.baseline_reduce)
        if value is None or value == self.global_baseline:
            return []
        self.global_baseline = value
        sync = Message(MessageType.BASELINE_SYNC, {"global_baseline": value})
        return [Outgoing(m, REQUEST_TAG, sync) for m in self.managers if m not in self.exited | self.lost]

    def _error(self, src: int, text: str) -> list[Outgoing]:
        self.errors += 1
        logger.warning("replay-buffer coordinator: %s", text)
        if src in self.managers:  # managers do not read the trainers' reply channel
            return []
        return [Outgoing(src, STATS_TAG, Message(MessageType.ERROR, {"error": text}))]

    def run(self, idle_timeout: float | None = None) -> dict[str, Any]:
        """Serve until every manager has exited; returns the final population stats.

        CommTimeout if nothing arrives for ``idle_timeout`` seconds (default: the world's timeout).
        """
        comm = resolve_group(self.group)
        limit = resolve_timeout(idle_timeout, comm.timeout, "idle_timeout", "Coordinator.run")
        pending: list[tuple[int, messages.SendHandle]] = []
        while not self.done:
            try:
                src, payload = next_message(comm, self.group, limit, COORDINATOR_TAG)
                outgoing = self.handle(src, from_payload(payload))
            except messages.FrameError as e:
                outgoing = self._error(e.src, f"undecodable message from rank {e.src}: {e}")
            except ProtocolError as e:
                outgoing = self._error(src, f"malformed message from rank {src}: {e}")
            except CommTimeout as e:
                waiting = sorted(set(self.managers) - self.exited - self.lost)
                raise CommTimeout(f"coordinator {comm.rank} heard nothing for {limit:g} s; managers {waiting} have "
                                  "not exited", tuple(waiting)) from e
            except PeerFailure as e:
                pending = self._after_loss(comm, e, pending)
                continue
            except WorldChanging:
                pending = self._reform(comm.world)
                continue
            pending += [(out.dst, send_outgoing(out, self.group, self.timeout)) for out in outgoing]
            pending = [(dst, h) for dst, h in pending if not h.done()]
        for _, handle in pending:
            handle.wait(self.timeout)
        return self.population_stats()

    def _after_loss(self, comm: Comm, error: PeerFailure,
                    pending: list[tuple[int, messages.SendHandle]]) -> list[tuple[int, messages.SendHandle]]:
        """A rank was lost: re-form where the launcher restarts it, else drop a lost manager (named in
        the log and in ``lost_managers``) and go on; the sends still pending to live ranks."""
        lost = set(error.ranks)
        managers = lost & set(self.managers)
        world = comm.world
        if world.restarts_lost_ranks or world.elastic:
            logger.warning("replay-buffer coordinator: rank(s) %s lost, or left to re-form; re-forming the world",
                           sorted(lost))
            return self._reform(world)
        if not error.exact:
            raise error
        for rank in sorted(managers - self.lost - self.exited):
            logger.warning("replay-buffer coordinator: manager %s was lost (%s); the batches it stored are gone, "
                           "coordinating the others on", rank, error)
            self.baselines.pop(rank, None)
        self.lost |= managers
        return [(dst, h) for dst, h in pending if dst not in lost]

    def _reform(self, world: Any) -> list[tuple[int, messages.SendHandle]]:
        """Form the world's next generation with the others, keeping the modes and baselines: a restarted
        manager starts empty; in an elastic world every rank may have a new number (the modes of agents
        that left for good stay in ``modes``, no longer counted by rank). No send is pending after it."""
        fresh, moved = reform_service(world, self.roles, "Coordinator.from_context")
        if moved is not None:
            self.managers = tuple(self.roles.layout.buffer_ranks)
            self.exited = moved_ranks(self.exited, moved)
            self.baselines = moved_keys(self.baselines, moved)
            self.modes_by_rank = Counter(moved_keys(self.modes_by_rank, moved))
        for rank in fresh & set(self.managers):  # restarted: starts empty
            self.exited.discard(rank)
            self.baselines.pop(rank, None)
        return []

