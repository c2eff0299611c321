"""World and Group: who am I, how many are we, and the communicator every feature runs over.

``popmesh.init()`` creates the World once per process. A :class:`Group` (``world.new_group(ranks)``)
is usable everywhere a World is: collectives reduce over the group and divide by its own size.
Ranks are global unless a name says otherwise (``group_rank``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from popmesh.comm import tracing
from popmesh.comm.agreement import exchange_texts
from popmesh.comm.signature import History
from popmesh.core import trace as timeline
from popmesh.core.errors import ConfigError, NotInGroup, PeerFailure, know_hosts
from popmesh.core.launch_env import (
    detect_engine,
    launcher_elastic,
    launcher_restarts,
    read_check,
    read_timeout,
    restart_count,
)
from popmesh.core.timeouts import check_timeout, resolve_timeout
from popmesh.core.trace import DEFAULT_CAPACITY, TRACE_ENV
from popmesh.engines import Engine, GroupSpec, create_engine

__all__ = ["Comm", "World", "Group", "init", "current_world", "resolve_group", "finalize"]

_HOSTNAME_NBYTES = 256


class Comm:
    """What World and Group share: the member ranks and the engine handle used by collectives."""

    def __init__(self, world: World | None, spec: GroupSpec, handle: Any) -> None:
        if world is None:  # only a World is its own world
            if not isinstance(self, World):
                raise TypeError("a Group needs the World it belongs to")
            world = self
        self._world = world
        self.spec = spec
        self.handle = handle
        self.history = History()  # the verified sized collectives on this group (popmesh.comm.guard)

    @property
    def world(self) -> World:
        return self._world

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the members, in group-rank order."""
        return self.spec.ranks

    @property
    def size(self) -> int:
        return len(self.spec.ranks)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.world.engine.rank

    @property
    def is_member(self) -> bool:
        return self.handle is not None

    @property
    def group_rank(self) -> int:
        """This process's position in the group; NotInGroup if it is not a member."""
        self.require_member("group_rank")
        return self.spec.group_rank(self.rank)

    def to_group_rank(self, global_rank: int) -> int:
        """Translate a global rank of a member into its group rank."""
        if global_rank not in self.spec.ranks:
            raise ConfigError(f"rank {global_rank} is not in {self._describe()}: pass a member's global rank")
        return self.spec.group_rank(global_rank)

    def require_member(self, what: str) -> None:
        if self.handle is None:
            raise NotInGroup(
                f"rank {self.rank} called {what} on {self._describe()}, which it is not a member of: "
                "call it only on members (check group.is_member)"
            )

    @property
    def timeout(self) -> float:
        return self.world.default_timeout

    @property
    def check(self) -> bool:
        return self.world.check_mode

    @property
    def native(self) -> Any:
        """The engine's own communicator for this group: a torch ProcessGroup (torch's non-member
        sentinel on non-members), an ``mpi4py`` communicator (``COMM_NULL`` on non-members), or None
        on the local engine. For code that calls the engine itself (``dist.barrier(group=...)``)."""
        return self.world.engine.native_group(self.handle)

    def _describe(self) -> str:
        return f"group {list(self.spec.ranks)}" if self.spec.gid else "the world"


class World(Comm):
    """All ranks of one job on one engine. Use as a context manager or call :meth:`finalize`."""

    def __init__(self, engine: Engine, timeout: float, check: bool) -> None:
        self.engine = engine
        self.default_timeout = float(timeout)
        self.check_mode = bool(check)
        self._next_gid = 1
        self._finalized = False
        self._survivors: Group | None = None  # this generation's survivors' group, once formed (survivors())
        spec = GroupSpec(0, tuple(range(engine.size)))
        super().__init__(None, spec, engine.make_group(spec, timeout))
        self.hostname = engine.hostname()
        if engine.generation > 0:  # restarted or started later: the world it joined may lose a rank as it forms
            self._form(time.monotonic() + self.default_timeout)
        else:
            self.hostnames: list[str] = self._gather_hostnames()
            know_hosts(self.hostnames)  # failures name the host of each rank at fault
            self.local_rank, self.local_size = engine.local_topology() or self._local_from_hostnames()

    @property
    def engine_name(self) -> str:
        return self.engine.name

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return len(set(self.hostnames))

    def failure(self, ranks: Collection[int] | None = None) -> PeerFailure | None:
        """A rank of ``ranks`` (None: any) that the heartbeat found frozen or dead, as the PeerFailure
        that names it, or None. Background services poll this to stop within seconds of a loss."""
        return self.engine.peer_failure(ranks)

    @property
    def generation(self) -> int:
        """How many times this world has re-formed (0: the world as first formed)."""
        return self.engine.generation

    @property
    def newcomers(self) -> tuple[int, ...]:
        """The ranks that joined the current generation as new processes (restarted for lost ranks);
        () in the world as first formed. A newcomer sees its own rank here: it has state to receive."""
        return self.engine.newcomers

    @property
    def roster(self) -> tuple[int, ...]:
        """The launcher's number of each rank (its ``RANK`` variable), in rank order. Ranks are renumbered
        when an elastic world (``popmesh launch --nnodes MIN:MAX``) loses one for good, and these are
        not: key what must survive a re-form (an agent's identity, its files) by them. A joined rank's
        number comes from its node: ``node_rank * nproc_per_node + local_rank``."""
        return self.engine.roster

    @property
    def restart_count(self) -> int:
        """How many times the launcher started this process again: 0 in its first life, 1 after the first
        restart (``popmesh launch --max-restarts N``; on MPI and under torchrun the whole job restarts).
        A script's own fault injection checks it, so that the restarted process does not fail again."""
        return restart_count()

    @property
    def restarts_lost_ranks(self) -> bool:
        """True when a lost rank comes back (``popmesh launch --max-restarts N`` with N > 0, torch
        engine): survivors should :meth:`reform` rather than stop. Services use it to choose."""
        return self.engine_name == "torch" and launcher_restarts() > 0

    @property
    def elastic(self) -> bool:
        """True in a world that may change size (``popmesh launch --nnodes MIN:MAX``, torch engine): later
        launchers' ranks join it and ranks lost with no restart left leave it for good, so survivors and
        services :meth:`reform` after a loss, and poll :meth:`newcomer_waiting` to take newcomers in."""
        return self.engine_name == "torch" and launcher_elastic()

    def reform(self, timeout: float | None = None) -> tuple[int, ...]:
        """After a lost rank (a PeerFailure, ``failure()``), form the world again with the process the
        launcher restarted for it (``popmesh launch --max-restarts N``): a new process group on the same
        engine, under a new generation of the rendezvous. Every surviving rank calls this; the restarted
        process joins from ``init()``. Returns :attr:`newcomers`, whose state the survivors hand over
        (``broadcast``, ``send``); a rank lost again as the world forms makes it form once more, and a
        newcomer of the lost attempt is a newcomer again. Groups made with ``new_group`` before belong to
        the old generation: make them again, in the same order on every rank. torch engine only (MPI:
        ConfigError)."""
        seconds = resolve_timeout(timeout, self.default_timeout, "timeout", "reform")
        deadline = time.monotonic() + seconds
        self.engine.reform(seconds)
        self._form(deadline)
        return self.newcomers

    def try_reform(self, timeout: float | None = None) -> tuple[int, ...] | None:
        """:meth:`reform` for survivors that carry on while the lost rank restarts: the first call leaves
        the generation that lost it (its groups, transport and heartbeat are gone, so nothing of it can
        block this rank); every call returns None at once until the restarted process waits to join,
        then forms the next generation (waiting only for the other survivors, within ``timeout``) and
        returns :attr:`newcomers`. Between the first call and the last, use no collective or message
        of this world: train alone, and call this again (for example once per iteration). After
        :meth:`survivors`, this generation (and the survivors' group) lives on until the next one forms:
        the survivors go on together, and the world's own collectives fail (PeerFailure)."""
        seconds = resolve_timeout(timeout, self.default_timeout, "timeout", "try_reform")
        fresh = self.engine.try_reform(seconds)
        if fresh is None:
            if self._survivors is None:  # a survivors' group keeps this generation until the next one forms
                self.handle = _LeftGeneration(self.generation)
        elif not self._finish_forming(time.monotonic() + seconds):  # a rank lost as it formed: alone again
            return None
        return fresh

    def newcomer_waiting(self) -> bool:
        """Whether the process restarted for a lost rank waits to join (two reads of the rendezvous store,
        no wait): survivors working together (:meth:`survivors`) poll this once per step, wind down
        what runs on their group, and then :meth:`reform`, which waits only for the other survivors. In
        an elastic world also true for a later launcher's ranks waiting to join, and once a rank was
        marked left for good (the re-form is then without it; three reads)."""
        return self.engine.newcomer_waiting()

    def admit(self, timeout: float | None = None) -> tuple[int, ...]:
        """At a safe point of the training loop (every rank calls it at the same step: a step boundary, a
        population's decision point), take in the processes that wait to join: a launcher's ranks started
        later in an elastic world (``popmesh launch --nnodes MIN:MAX``), or processes restarted for lost
        ranks. If any rank sees one waiting (two store reads each), every rank forms the next generation
        with them (:meth:`reform`) and gets :attr:`newcomers`, whose state it hands over; else ``()`` at
        the cost of one one-byte all-gather. torch engine; on other engines always ``()``."""
        seconds = resolve_timeout(timeout, self.default_timeout, "timeout", "admit")
        if self.engine_name != "torch":
            return ()
        said = exchange_texts(self, "1" if self.engine.newcomer_waiting() else "0", 1, seconds)
        return self.reform(seconds) if "1" in said else ()

    def survivors(self, timeout: float | None = None) -> Group:
        """After a lost rank (a PeerFailure, ``failure()``), the ranks still alive as a group of their own,
        so that they go on together while the lost rank restarts: collectives and messages over it
        never involve a lost rank. Every survivor calls this; they agree on its members through the
        rendezvous (a rank the heartbeat has not yet named lost waits until it is, within ``timeout``).
        This generation and the group live until the next generation forms: check
        :meth:`newcomer_waiting` once per step, and once it is true wind down what runs on the group
        and call :meth:`reform` (or call :meth:`try_reform` once per step, if nothing needs winding
        down). A second loss among the survivors fails the group's calls (PeerFailure; ``failure(
        group.ranks)`` names it): call this again for a smaller group. torch engine only (MPI:
        ConfigError, as :meth:`reform`)."""
        seconds = resolve_timeout(timeout, self.default_timeout, "timeout", "survivors")
        members, handle = self.engine.survivors(self._next_gid, seconds)
        spec = GroupSpec(self._next_gid, tuple(members))
        self._next_gid += 1
        self._survivors = Group(self, spec, handle)
        self.handle = _LeftGeneration(self.generation, lost=tuple(r for r in range(self.size) if r not in members))
        return self._survivors

    def _form(self, deadline: float) -> None:
        """Finish forming the generation the engine joined; where a rank was lost meanwhile, join the next one
        (with that rank's restarted process) and finish that, until one forms (CommTimeout at ``deadline``)."""
        while not self._finish_forming(deadline):
            self.engine.reform(_left_of(deadline))

    def _finish_forming(self, deadline: float) -> bool:
        """Finish forming the generation the engine just joined (:meth:`_formed_again`); False where a rank was
        lost meanwhile: the generation is left, to be formed again with that rank's restarted process, and
        every process that joined it as new stays new in the next (it received nothing yet)."""
        try:
            self._formed_again(_left_of(deadline))
        except PeerFailure:
            self.handle = _LeftGeneration(self.generation)
            return False
        self.engine.settle()
        return True

    def _formed_again(self, timeout: float) -> None:
        """After the engine formed the next generation: the world's group, its size in an elastic world (ranks
        joined or left for good), and its host map are new."""
        self._survivors = None
        self._next_gid = 1
        self.spec = GroupSpec(0, tuple(range(self.engine.size)))
        self.handle = self.engine.make_group(self.spec, timeout)
        self.history = History()  # the mismatch guard's predictions start over: a newcomer has no history
        self.hostnames = self._gather_hostnames()
        know_hosts(self.hostnames)
        self.local_rank, self.local_size = self.engine.local_topology() or self._local_from_hostnames()

    def new_group(self, ranks: Sequence[int]) -> Group:
        """A sub-communicator over ``ranks`` (global). Every rank of the world must call this, in the
        same order, with the same list; non-members get a Group whose ``is_member`` is False."""
        if self._survivors is not None:
            lost = sorted(set(range(self.size)) - set(self._survivors.ranks))
            raise ConfigError(f"new_group(): this generation lost rank(s) {lost}, and a group of it needs every rank; "
                              "use world.survivors()'s group until world.reform(), then make groups again")
        members = tuple(int(r) for r in ranks)
        if not members or len(set(members)) != len(members) or not all(0 <= r < self.size for r in members):
            raise ConfigError(f"new_group({list(ranks)}): ranks must be distinct and in [0, {self.size})")
        spec = GroupSpec(self._next_gid, members)
        self._next_gid += 1
        return Group(self, spec, self.engine.make_group(spec, self.default_timeout))

    def start_trace(self, directory: str | os.PathLike[str], *, capacity: int = DEFAULT_CAPACITY,
                    timeout: float | None = None) -> None:
        """Record the trace timeline into ``directory`` (see docs/observe.md): collective, every rank passes
        the same folder; ``finalize`` (or :meth:`stop_trace`) writes it. Same as ``init(trace=...)``."""
        tracing.start(self, directory, capacity=capacity, timeout=timeout)

    def stop_trace(self, *, merge: bool | None = None) -> Path | None:
        """Stop recording and write this rank's file (merged into ``trace.json`` when all are there)."""
        return tracing.stop(self, merge=merge)

    def finalize(self) -> None:
        """Shut the engine down. Idempotent; also runs at interpreter exit."""
        global _CURRENT
        if self._finalized:
            return
        self._finalized = True
        if isinstance(self.engine, tracing.TracedEngine):
            with contextlib.suppress(OSError):  # a trace that cannot be written never fails the run
                tracing.stop(self)
        self.engine.finalize()
        if _CURRENT is self:
            _CURRENT = None

    @property
    def finalized(self) -> bool:
        return self._finalized

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finalize()

    def __repr__(self) -> str:
        return f"World(engine={self.engine.name!r}, rank={self.rank}, size={self.size}, host={self.hostname!r})"

    def _gather_hostnames(self) -> list[str]:
        """Every rank's host name, gathered straight through the engine as fixed-width UTF-8
        (host names are at most 255 bytes), so the world needs nothing from the collectives above it."""
        if self.size == 1:
            return [self.hostname]
        return exchange_texts(self, self.hostname, _HOSTNAME_NBYTES, self.default_timeout)

    def _local_from_hostnames(self) -> tuple[int, int]:
        same = [r for r, h in enumerate(self.hostnames) if h == self.hostname]
        return same.index(self.rank), len(same)


class Group(Comm):
    """A subset of a World's ranks. Usable everywhere a World is."""

    def __repr__(self) -> str:
        return f"Group(ranks={list(self.ranks)}, member={self.is_member})"


_CURRENT: World | None = None


def _left_of(deadline: float) -> float:
    """The seconds left until ``deadline``, at least a tenth of one (a call that is due at once says so)."""
    return max(deadline - time.monotonic(), 0.1)


class _LeftGeneration:
    """The world's group handle between the first :meth:`World.try_reform` and the last: any collective
    on it says what to do, instead of torch's "default process group has not been initialized"."""

    __slots__ = ("_generation", "_lost")

    def __init__(self, generation: int, lost: tuple[int, ...] = ()) -> None:
        self._generation, self._lost = generation, lost

    def __getattr__(self, name: str) -> Any:
        if self._lost:
            raise ConfigError(f"generation {self._generation} of the world lost rank(s) {list(self._lost)}: its "
                              "survivors work in world.survivors()'s group (pass group=) until world.try_reform() "
                              "returns the newcomers; the world's own collectives wait for that")
        raise ConfigError(f"this rank left generation {self._generation} of the world after a lost rank "
                          "(world.try_reform()) and is not in the next one yet: call world.try_reform() until it "
                          "returns the newcomers (or world.reform() to wait for them) before any collective")


def init(engine: str = "auto", timeout: float | None = None, check: bool | None = None,
         trace: str | os.PathLike[str] | None = None, **options: Any) -> World:
    """Create (or return) this process's World.

    ``engine``: ``auto`` (mpiexec → mpi; torchrun / popmesh launch → torch; else local), ``local``,
    ``torch`` or ``mpi``. ``timeout``: default seconds for every blocking call (``POPMESH_TIMEOUT``,
    else 300). ``check``: verify op, shape and dtype across ranks before each collective
    (``POPMESH_CHECK=1``). ``trace``: record the trace timeline into this folder (``POPMESH_TRACE``,
    set by ``popmesh launch --trace DIR``); see :meth:`World.start_trace`. ``fingerprint`` (torch engine,
    elastic worlds): a text that names what every rank trains, such as
    ``popmesh.torch.model_fingerprint(model)``; a process that would join the running world with
    another is refused (ConfigError) before the world sees it.
    """
    global _CURRENT
    name = detect_engine() if engine == "auto" else engine
    seconds = read_timeout() if timeout is None else check_timeout(timeout, "timeout", "popmesh.init")
    if _CURRENT is not None and not _CURRENT.finalized:
        if _CURRENT.engine.name != name:
            raise ConfigError(f"a {_CURRENT.engine.name} world already exists: finalize it before init({name!r})")
        _check_trace_of_existing(trace)
        return _CURRENT
    world = World(create_engine(name, seconds, **options), seconds, read_check() if check is None else check)
    _CURRENT = world
    folder = os.environ.get(TRACE_ENV) if trace is None else trace
    if folder:
        world.start_trace(folder)
    return world


def _check_trace_of_existing(trace: str | os.PathLike[str] | None) -> None:
    """``init(trace=DIR)`` on a world that exists: fine if it already records into DIR, else a
    ConfigError (the option applies when a world is created, and starting a trace is collective)."""
    if trace is None:
        return
    recording = timeline.ACTIVE.directory if timeline.ACTIVE is not None else None
    if recording is None or Path(recording).resolve() != Path(trace).resolve():
        raise ConfigError(f"init(trace={str(trace)!r}) on a world that already exists"
                          f"{f' and records into {recording}' if recording else ''}: trace= applies only when "
                          "init creates the world; call world.start_trace(DIR) on every rank instead")


def current_world() -> World:
    """The World from :func:`init`; outside a distributed launch, a world of one is created on demand."""
    if _CURRENT is not None and not _CURRENT.finalized:
        return _CURRENT
    if detect_engine() != "local":
        raise ConfigError("this process was launched as part of a distributed job: call popmesh.init() first")
    return init("local")


def resolve_group(group: Comm | None) -> Comm:
    """``group`` itself, or the current world when None."""
    return current_world() if group is None else group


def finalize() -> None:
    """Finalize the current world if there is one."""
    if _CURRENT is not None:
        _CURRENT.finalize()


atexit.register(finalize)
