"""Rank layout: which global ranks train, which serve replay buffers, which coordinates.

:class:`RankLayout` is pure data, built once (on every rank, or on one and broadcast with
:meth:`RankLayout.to_dict`) and turned into process groups by the world layer. Roles:

* **training** (agent) ranks, partitioned into ``num_agent_groups`` equal **agent groups**
  (the groups that average weights with each other);
* **buffer** (replay-buffer manager) ranks, each serving a fixed set of training ranks;
* an optional **coordinator**, always the last global rank.

:meth:`RankLayout.build` follows torchgfn's arithmetic: the world is cut into one chunk of
consecutive ranks per manager, the manager last, agents split ceil/floor over managers; the
coordinator sits outside every chunk. :meth:`RankLayout.from_hostnames` does the same per node
so each manager lives on the node of the agents it serves, for block and cyclic placement.
Agent groups are consecutive slices of the training ranks in chunk order, so they stay on one
node whenever the numbers allow.

Deliberate fixes over torchgfn's ``RankLayout``: the default is **no** buffer managers (its
driver default of one silently took a rank away from training); bad sizes raise
:class:`~popmesh.core.errors.ConfigError` saying what to change instead of ``assert``; every layout,
including one read back with :meth:`from_dict`, is checked to be an exact partition of the world;
``from_hostnames`` keeps agent groups node-local also without buffers; and the "agent groups
span nodes" warning is not raised when a single agent group is asked for.
"""

from __future__ import annotations

import numbers
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from popmesh.core.errors import ConfigError

__all__ = ["RankLayout", "LayoutWarning", "Role"]

Role = Literal["training", "buffer", "coordinator"]

_FIELDS = ("world_size", "training_ranks", "buffer_ranks", "served_ranks", "agent_groups", "coordinator_rank")


class LayoutWarning(UserWarning):
    """A legal layout that is probably not what was wanted (e.g. managers on other nodes)."""


def _split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal parts of ``total``; the first ``total % parts`` get one more."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _ranks(value: object, what: str, sort: bool = True) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(r) for r in value):
        raise ConfigError(f"{what} must be a list of integer ranks, got {value!r}")
    ranks = tuple(int(r) for r in value)
    return tuple(sorted(ranks)) if sort else ranks


def _fmt(ranks: Sequence[int]) -> str:
    """Compact rank list: ``[0-30, 32, 40-41]``."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return "[" + ", ".join(parts) + "]"


def _check_counts(world_size: int, num_buffers: int, num_agent_groups: int,
                  use_coordinator: object, num_nodes: int) -> None:
    """Raise ConfigError unless the requested role counts fit in the world."""
    for name, value, low in (("world_size", world_size, 1), ("num_buffers", num_buffers, 0),
                             ("num_agent_groups", num_agent_groups, 1), ("num_nodes", num_nodes, 1)):
        if not _is_int(value) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    if not isinstance(use_coordinator, bool):
        raise ConfigError(f"use_coordinator must be True or False, got {use_coordinator!r}")
    w, b, c = int(world_size), int(num_buffers), int(use_coordinator)
    need = b + max(1, b) + c
    if w < need:
        raise ConfigError(
            f"world_size={w} is too small for {b} buffer manager(s)"
            f"{' and a coordinator' if c else ''}: every manager needs at least one training rank to "
            f"serve and at least one training rank must remain, so at least {need} ranks are needed. "
            f"Launch more ranks or lower num_buffers{' / use_coordinator' if c else ''}.")


@dataclass(frozen=True)
class RankLayout:
    """Roles of every global rank of a world of ``world_size`` ranks.

    ``buffer_ranks[i]`` serves ``served_ranks[i]`` (both empty without buffers); ``agent_groups``
    partitions ``training_ranks`` into equal groups (empty means one group of all training ranks).
    Rank lists are stored sorted; the order of ``buffer_ranks`` and ``agent_groups`` is kept.
    Construction checks that roles partition ``range(world_size)`` exactly.
    """

    world_size: int
    training_ranks: tuple[int, ...]
    buffer_ranks: tuple[int, ...] = ()
    served_ranks: tuple[tuple[int, ...], ...] = ()
    agent_groups: tuple[tuple[int, ...], ...] = ()
    coordinator_rank: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if self.coordinator_rank is not None and not _is_int(self.coordinator_rank):
            raise ConfigError(f"coordinator_rank must be an integer rank or None, got {self.coordinator_rank!r}")
        set_ = object.__setattr__
        set_(self, "world_size", int(self.world_size))
        if self.coordinator_rank is not None:
            set_(self, "coordinator_rank", int(self.coordinator_rank))
        training = _ranks(self.training_ranks, "training_ranks")
        set_(self, "training_ranks", training)
        set_(self, "buffer_ranks", _ranks(self.buffer_ranks, "buffer_ranks", sort=False))
        if not isinstance(self.served_ranks, (list, tuple)) or not isinstance(self.agent_groups, (list, tuple)):
            raise ConfigError("served_ranks and agent_groups must be lists of rank lists")
        set_(self, "served_ranks", tuple(_ranks(s, "served_ranks entry") for s in self.served_ranks))
        groups = tuple(_ranks(g, "agent_groups entry") for g in self.agent_groups) or (training,)
        set_(self, "agent_groups", groups)
        self._check_roles()
        self._check_assignment()
        self._check_groups()

    def _check_roles(self) -> None:
        coord = () if self.coordinator_rank is None else (self.coordinator_rank,)
        everyone = [*self.training_ranks, *self.buffer_ranks, *coord]
        last = self.world_size - 1
        outside = sorted(r for r in everyone if not 0 <= r <= last)
        if outside:
            raise ConfigError(f"ranks {outside} are outside the world of {self.world_size} ranks (0..{last})")
        dup = sorted(r for r, n in Counter(everyone).items() if n > 1)
        if dup:
            raise ConfigError(f"ranks {_fmt(dup)} have more than one role (training, buffer, coordinator); "
                              "give each rank one role")
        missing = sorted(set(range(self.world_size)) - set(everyone))
        if missing:
            raise ConfigError(f"ranks {_fmt(missing)} have no role; every rank of the world must train, "
                              "serve a buffer or coordinate")
        if not self.training_ranks:
            raise ConfigError("a layout needs at least one training rank")

    def _check_assignment(self) -> None:
        if len(self.served_ranks) != len(self.buffer_ranks):
            raise ConfigError(f"{len(self.buffer_ranks)} buffer ranks but {len(self.served_ranks)} served_ranks "
                              "entries; give one list of served training ranks per buffer rank")
        if not self.buffer_ranks:
            return
        served = [r for s in self.served_ranks for r in s]
        if any(not s for s in self.served_ranks):
            raise ConfigError("every buffer manager must serve at least one training rank")
        if len(served) != len(set(served)) or set(served) != set(self.training_ranks):
            raise ConfigError("served_ranks must assign every training rank to exactly one buffer manager, got "
                              f"{[_fmt(s) for s in self.served_ranks]} for training ranks {_fmt(self.training_ranks)}")

    def _check_groups(self) -> None:
        sizes = [len(g) for g in self.agent_groups]
        members = [r for g in self.agent_groups for r in g]
        if len(set(sizes)) != 1 or 0 in sizes:
            raise ConfigError(f"agent groups must be non-empty and of equal size, got sizes {sizes}")
        if len(members) != len(set(members)) or set(members) != set(self.training_ranks):
            raise ConfigError("agent_groups must partition the training ranks exactly, got "
                              f"{[_fmt(g) for g in self.agent_groups]} for training ranks {_fmt(self.training_ranks)}")

    # --- derived sizes ---------------------------------------------------------------------

    @property
    def num_training_ranks(self) -> int:
        """How many ranks train agents."""
        return len(self.training_ranks)

    @property
    def num_buffers(self) -> int:
        """How many ranks manage replay buffers."""
        return len(self.buffer_ranks)

    @property
    def num_agent_groups(self) -> int:
        """How many agent groups the training ranks form."""
        return len(self.agent_groups)

    @property
    def agent_group_size(self) -> int:
        """Training ranks per agent group (all groups have this size)."""
        return len(self.agent_groups[0])

    # --- per-rank queries ------------------------------------------------------------------

    @cached_property
    def _buffer_of(self) -> dict[int, int]:
        return {a: m for m, served in zip(self.buffer_ranks, self.served_ranks) for a in served}

    @cached_property
    def _group_of(self) -> dict[int, int]:
        return {r: g for g, members in enumerate(self.agent_groups) for r in members}

    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank!r} is not a rank of this layout's world (0..{self.world_size - 1})")

    def role(self, rank: int) -> Role:
        """``"training"``, ``"buffer"`` or ``"coordinator"`` for global ``rank``."""
        self._check_rank(rank)
        if rank == self.coordinator_rank:
            return "coordinator"
        return "buffer" if rank in self.buffer_ranks else "training"

    def assigned_buffer(self, rank: int) -> int | None:
        """The manager serving training rank ``rank``; None without buffers or for non-training ranks."""
        self._check_rank(rank)
        return self._buffer_of.get(rank)

    def assigned_training_ranks(self, rank: int) -> list[int] | None:
        """The training ranks served by manager ``rank``; None if ``rank`` is not a manager."""
        self._check_rank(rank)
        if rank not in self.buffer_ranks:
            return None
        return list(self.served_ranks[self.buffer_ranks.index(rank)])

    def agent_group_id(self, rank: int) -> int:
        """Index of ``rank``'s agent group; a manager reports its first agent's group, the coordinator 0."""
        self._check_rank(rank)
        if rank in self.buffer_ranks:
            rank = self.served_ranks[self.buffer_ranks.index(rank)][0]
        return self._group_of.get(rank, 0)

    # --- reporting and transport -----------------------------------------------------------

    def summary(self, num_nodes: int | None = None) -> str:
        """Multi-line human-readable description, for logs."""
        nodes = "" if num_nodes is None else f" on {num_nodes} node(s)"
        coord = "no coordinator" if self.coordinator_rank is None else f"coordinator rank {self.coordinator_rank}"
        lines = [f"{self.world_size} rank(s){nodes}: {self.num_training_ranks} training, "
                 f"{self.num_buffers} buffer manager(s), {coord}; "
                 f"{self.num_agent_groups} agent group(s) of {self.agent_group_size}."]
        lines += [f"  buffer manager {m} serves training ranks {_fmt(s)}"
                  for m, s in zip(self.buffer_ranks, self.served_ranks)]
        lines += [f"  agent group {g}: training ranks {_fmt(members)}" for g, members in enumerate(self.agent_groups)]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (lists and ints) that :meth:`from_dict` turns back into an equal layout."""
        return {
            "world_size": self.world_size,
            "training_ranks": list(self.training_ranks),
            "buffer_ranks": list(self.buffer_ranks),
            "served_ranks": [list(s) for s in self.served_ranks],
            "agent_groups": [list(g) for g in self.agent_groups],
            "coordinator_rank": self.coordinator_rank,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankLayout:
        """Rebuild (and re-validate) a layout from :meth:`to_dict` output; ConfigError if malformed."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a RankLayout dict must be a mapping, got {type(data).__name__}")
        unknown, missing = sorted(set(data) - set(_FIELDS)), [k for k in _FIELDS if k not in data]
        if unknown or missing:
            raise ConfigError(f"malformed RankLayout dict: missing keys {missing}, unknown keys {unknown}; "
                              "pass the output of RankLayout.to_dict()")
        return cls(**{k: data[k] for k in _FIELDS})

    # --- constructors ----------------------------------------------------------------------

    @classmethod
    def build(cls, world_size: int, num_buffers: int = 0, num_agent_groups: int = 1,
              use_coordinator: bool = False, num_nodes: int = 1) -> RankLayout:
        """Arithmetic layout assuming nothing about hosts.

        With buffers, ranks ``0..`` are cut into ``num_buffers`` chunks of consecutive ranks
        (agents split ceil/floor, the manager last in its chunk); the coordinator is
        ``world_size - 1``. ``num_nodes`` only decides whether to warn that agent groups will
        span nodes. Example: world 8, 2 buffers -> managers [3, 7] serving [0, 1, 2] and [4, 5, 6].
        Without buffers the training ranks are ``0..T-1``; torchgfn's per-node ceil/floor chunks
        of them are consecutive too, so the agent groups are the same.
        """
        _check_counts(world_size, num_buffers, num_agent_groups, use_coordinator, num_nodes)
        if num_agent_groups > 1 and num_nodes > 1 and num_agent_groups % num_nodes:
            warnings.warn(f"num_agent_groups={num_agent_groups} is not a multiple of num_nodes={num_nodes}: "
                          "some agent groups will span nodes; use a multiple of num_nodes for node-local groups",
                          LayoutWarning, stacklevel=2)
        return cls._arithmetic(world_size, num_buffers, num_agent_groups, use_coordinator)

    @classmethod
    def _arithmetic(cls, world_size: int, num_buffers: int, num_agent_groups: int,
                    use_coordinator: bool) -> RankLayout:
        num_training = world_size - num_buffers - int(use_coordinator)
        if num_buffers == 0:
            chunks = [list(range(num_training))]
        else:
            chunks, start = [], 0
            for n_agents in _split_sizes(num_training, num_buffers):
                chunks.append(list(range(start, start + n_agents + 1)))
                start += n_agents + 1
        coordinator = world_size - 1 if use_coordinator else None
        return cls._from_chunks(world_size, chunks, num_agent_groups, num_buffers > 0, coordinator)

    @classmethod
    def from_hostnames(cls, hostnames: Sequence[str], num_buffers: int = 0, num_agent_groups: int = 1,
                       use_coordinator: bool = False) -> RankLayout:
        """Node-aware layout from every rank's hostname (``hostnames[r]`` is rank r's host).

        Nodes are ordered by their lowest rank. When ``num_buffers`` is a multiple of the number
        of nodes, each node's ranks (sorted, coordinator removed) are cut ceil/floor into
        ``num_buffers / num_nodes`` chunks whose last rank is the manager, so a manager always
        serves agents on its own node, whether ranks are placed in blocks or cyclically.
        Otherwise this warns (:class:`LayoutWarning`) and falls back to :meth:`build`.
        ConfigError when a node has fewer than two ranks per manager.
        """
        if isinstance(hostnames, (str, bytes)) or not all(isinstance(h, str) for h in hostnames):
            raise ConfigError("hostnames must be a sequence of host name strings, one per rank")
        world_size = len(hostnames)
        nodes: dict[str, list[int]] = {}
        for rank, host in enumerate(hostnames):
            nodes.setdefault(host, []).append(rank)
        _check_counts(world_size, num_buffers, num_agent_groups, use_coordinator, max(1, len(nodes)))
        if num_buffers % len(nodes):
            warnings.warn(f"num_buffers={num_buffers} is not a multiple of the {len(nodes)} nodes: managers may "
                          "serve agents on other nodes; use num_buffers = k * num_nodes for node-local managers",
                          LayoutWarning, stacklevel=2)
            layout = cls._arithmetic(world_size, num_buffers, num_agent_groups, use_coordinator)
        else:
            coordinator = world_size - 1 if use_coordinator else None
            chunks = _node_chunks(nodes, num_buffers // len(nodes), coordinator)
            layout = cls._from_chunks(world_size, chunks, num_agent_groups, num_buffers > 0, coordinator)
        _warn_if_groups_span(layout, hostnames)
        return layout

    @classmethod
    def _from_chunks(cls, world_size: int, chunks: list[list[int]], num_agent_groups: int,
                     managers: bool, coordinator: int | None) -> RankLayout:
        """Layout from rank chunks; the last rank of each chunk is its manager when ``managers``."""
        served = [chunk[:-1] if managers else chunk for chunk in chunks]
        training = [r for agents in served for r in agents]
        if len(training) % num_agent_groups:
            divisors = [d for d in range(1, len(training) + 1) if len(training) % d == 0]
            raise ConfigError(
                f"{len(training)} training ranks (world_size={world_size} minus {len(chunks) if managers else 0} "
                f"buffer manager(s) minus {int(coordinator is not None)} coordinator) cannot form "
                f"num_agent_groups={num_agent_groups} equal groups; use num_agent_groups in {divisors} "
                "or change world_size / num_buffers")
        size = len(training) // num_agent_groups
        return cls(
            world_size=world_size,
            training_ranks=tuple(training),
            buffer_ranks=tuple(chunk[-1] for chunk in chunks) if managers else (),
            served_ranks=tuple(tuple(s) for s in served) if managers else (),
            agent_groups=tuple(tuple(training[i * size:(i + 1) * size]) for i in range(num_agent_groups)),
            coordinator_rank=coordinator,
        )


def _node_chunks(nodes: dict[str, list[int]], managers_per_node: int, coordinator: int | None) -> list[list[int]]:
    """Cut each node's non-coordinator ranks into chunks (one per manager, or one per node without)."""
    chunks: list[list[int]] = []
    for host, ranks in nodes.items():
        ranks = [r for r in ranks if r != coordinator]
        if managers_per_node == 0:
            chunks += [ranks] if ranks else []
            continue
        if len(ranks) < 2 * managers_per_node:
            raise ConfigError(
                f"node {host!r} has {len(ranks)} usable rank(s) but {managers_per_node} manager(s) per node need at "
                f"least {2 * managers_per_node} (one manager + one agent each); put more ranks on every node "
                "or lower num_buffers")
        start = 0
        for size in _split_sizes(len(ranks), managers_per_node):
            chunks.append(ranks[start:start + size])
            start += size
    return chunks


def _warn_if_groups_span(layout: RankLayout, hostnames: Sequence[str]) -> None:
    if layout.num_agent_groups < 2:
        return
    spanning = [g for g, members in enumerate(layout.agent_groups) if len({hostnames[r] for r in members}) > 1]
    if spanning:
        warnings.warn(f"agent groups {spanning} span several nodes; for node-local groups give every node the same "
                      "number of training ranks and use num_agent_groups = k * num_nodes", LayoutWarning, stacklevel=3)
