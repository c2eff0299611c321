"""Chunk plans for handing a large state over: which bytes travel together, and who sends them to whom.

A model's and optimizer's state can be larger than one message should be (and than a donor can
afford to copy). :func:`plan_chunks` cuts the state's tensors, in order, into chunks of at most
``chunk_bytes``: small tensors share a chunk, a large one spans several, each piece starts at a byte
offset that is a multiple of its element size, and empty tensors take no room. :func:`plan_transfers`
spreads the (chunk, receiver) pairs over the donors, so that several donors share the sending.

Pure: plain descriptors in (:class:`TensorSpec`, strings and ints, no torch import), plain plans out,
tested without processes. Every rank plans from the same specs (the donor's, sent first) and so
derives the same plan.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from popmesh.core.dtypes import canonical_dtype, itemsize
from popmesh.core.errors import ConfigError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "TensorSpec",
    "Piece",
    "Chunk",
    "Transfer",
    "StreamPlan",
    "plan_chunks",
    "plan_transfers",
    "plan_stream",
    "compare_specs",
    "hand_over_roles",
    "fewest_applied",
    "survivors_of",
]

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""64 MiB: large enough for the transport's full speed, small enough to stage twice on the donor."""
MIN_CHUNK_BYTES = 16
"""The largest element (complex128) must fit in a chunk."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the state as the planner sees it: its name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"tensor name must be a string, got {self.name!r}")
        if not all(_is_int(d) and d >= 0 for d in self.shape):
            raise ConfigError(f"tensor {self.name!r}: shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def describe(self) -> str:
        """``float32 (4, 3)``: how error messages show it."""
        return f"{self.dtype} {self.shape}"


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` (C order) of tensor number ``tensor``, at byte ``offset`` of its chunk."""

    tensor: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Chunk:
    """One message of the stream: its pieces, in order, and its length in bytes (padding included)."""

    index: int
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class Transfer:
    """Global rank ``donor`` sends chunk number ``chunk`` to global rank ``receiver``."""

    chunk: int
    donor: int
    receiver: int


@dataclass(frozen=True)
class StreamPlan:
    """The whole hand-over: the tensors, their chunks, and every (chunk, donor, receiver) transfer."""

    specs: tuple[TensorSpec, ...]
    chunks: tuple[Chunk, ...]
    transfers: tuple[Transfer, ...]

    def sends_of(self, donor: int) -> list[tuple[int, tuple[int, ...]]]:
        """``(chunk, receivers)`` that ``donor`` sends, in chunk order."""
        per_chunk: dict[int, list[int]] = {}
        for t in self.transfers:
            if t.donor == donor:
                per_chunk.setdefault(t.chunk, []).append(t.receiver)
        return [(c, tuple(rs)) for c, rs in sorted(per_chunk.items())]

    def receives_of(self, receiver: int) -> list[tuple[int, int]]:
        """``(chunk, donor)`` that ``receiver`` takes, in chunk order (each chunk exactly once)."""
        return sorted((t.chunk, t.donor) for t in self.transfers if t.receiver == receiver)

    def bytes_sent(self, donor: int) -> int:
        """How many bytes ``donor`` puts on the wire."""
        return sum(self.chunks[t.chunk].nbytes for t in self.transfers if t.donor == donor)

    @property
    def nbytes(self) -> int:
        """The state's size: the bytes one receiver takes (padding included)."""
        return sum(c.nbytes for c in self.chunks)


def plan_chunks(specs: Sequence[TensorSpec], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[Chunk, ...]:
    """Cut ``specs``' tensors, in order, into chunks of at most ``chunk_bytes``.

    A tensor of at least a quarter of ``chunk_bytes`` takes chunks of its own, each one contiguous
    range of it (a donor sends those straight from its memory; the last may be shorter); smaller ones
    are packed together, whole, each piece at a byte offset that is a multiple of its element size (so
    a receiver can view it as its dtype). Empty tensors take no piece. Every element of every tensor is
    in exactly one piece.
    """
    if not _is_int(chunk_bytes) or isinstance(chunk_bytes, bool) or chunk_bytes < MIN_CHUNK_BYTES:
        raise ConfigError(f"chunk_bytes={chunk_bytes!r} must be an int of at least {MIN_CHUNK_BYTES} (bytes); "
                          f"the default is {DEFAULT_CHUNK_BYTES}")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    used = 0

    def close() -> None:
        nonlocal pieces, used
        if pieces:
            chunks.append(Chunk(len(chunks), tuple(pieces), used))
        pieces, used = [], 0

    for i, spec in enumerate(specs):
        size, numel = spec.itemsize, spec.numel
        if not numel:
            continue
        if spec.nbytes >= chunk_bytes // 4:
            close()
            per = chunk_bytes // size
            for start in range(0, numel, per):
                stop = min(numel, start + per)
                chunks.append(Chunk(len(chunks), (Piece(i, start, stop, 0),), (stop - start) * size))
            continue
        offset = -(-used // size) * size
        if offset + spec.nbytes > chunk_bytes:
            close()
            offset = 0
        pieces.append(Piece(i, 0, numel, offset))
        used = offset + spec.nbytes
    close()
    return tuple(chunks)


def plan_transfers(chunks: Sequence[Chunk], donors: Sequence[int], receivers: Sequence[int]) -> tuple[Transfer, ...]:
    """Every receiver takes every chunk once; the pairs go round the donors (chunk ``c`` reaches
    receiver number ``j`` from donor number ``(c + j) % len(donors)``), so each donor sends an even
    share and each receiver hears from every donor. ConfigError for a rank that is both, a repeated
    rank, or receivers without a donor."""
    donors, receivers = tuple(donors), tuple(receivers)
    for what, ranks in (("donors", donors), ("receivers", receivers)):
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"{what}={list(ranks)} names a rank twice")
    both = sorted(set(donors) & set(receivers))
    if both:
        raise ConfigError(f"rank(s) {both} are both donors and receivers: a rank either holds the state or takes it")
    if receivers and not donors:
        raise ConfigError(f"receivers {list(receivers)} but no donor: name at least one rank that holds the state")
    k = len(donors)
    return tuple(Transfer(c.index, donors[(c.index + j) % k], r) for c in chunks for j, r in enumerate(receivers))


def plan_stream(specs: Sequence[TensorSpec], donors: Sequence[int], receivers: Sequence[int],
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> StreamPlan:
    """:func:`plan_chunks` then :func:`plan_transfers`, as one plan."""
    chunks = plan_chunks(specs, chunk_bytes)
    return StreamPlan(tuple(specs), chunks, plan_transfers(chunks, donors, receivers))


def compare_specs(theirs: Sequence[TensorSpec], mine: Sequence[TensorSpec], *, them: str = "the donor") -> str | None:
    """The first way ``mine`` differs from ``theirs`` (names, dtypes, shapes; order aside), naming the
    tensor, or None when they agree."""
    own = {s.name: s for s in mine}
    names = {s.name for s in theirs}
    for spec in theirs:
        here = own.get(spec.name)
        if here is None:
            return f"tensor {spec.name!r} ({spec.describe()} on {them}) is missing here"
        if (here.dtype, here.shape) != (spec.dtype, spec.shape):
            return f"tensor {spec.name!r} is {here.describe()} here and {spec.describe()} on {them}"
    extra = [s.name for s in mine if s.name not in names]
    if extra:
        return f"tensor {extra[0]!r} is here but not on {them}"
    return None


def hand_over_roles(ranks: Sequence[int], src: int, newcomers: Sequence[int] = (), donors: int = 1,
                    holders: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Who sends and who takes in a hand-over among ``ranks``: ``(donors, receivers)``.

    One donor: ``src`` gives every other rank its state. ``donors`` > 1: ``src`` and the lowest other
    ``holders`` (the ranks that hold ``src``'s state; default the survivors, ranks not in
    ``newcomers``, as data-parallel ranks do), up to ``donors`` of them, share the sending, and only the
    other ranks take the state.
    """
    if not _is_int(donors) or isinstance(donors, bool) or donors < 1:
        raise ConfigError(f"donors={donors!r} must be an int of at least 1")
    if src not in ranks:
        raise ConfigError(f"src={src} is not one of the ranks {list(ranks)}: pass a member's global rank")
    if donors == 1:
        return (src,), tuple(r for r in ranks if r != src)
    if src in newcomers:
        raise ConfigError(f"src={src} joined as a new process and holds no state to give: pick a survivor")
    held = [r for r in ranks if r not in newcomers] if holders is None else [r for r in ranks if r in holders]
    if src not in held:
        raise ConfigError(f"src={src} is not among the ranks that hold the state to give ({held})")
    givers = (src, *[r for r in held if r != src][: donors - 1])
    return givers, tuple(r for r in ranks if r not in held)


def fewest_applied(ranks: Sequence[int], applied: Sequence[object], newcomers: Sequence[int] = ()) -> tuple[int, ...]:
    """The survivors (``ranks`` not in ``newcomers``) that applied the fewest steps, ascending.

    ``applied[i]``: how many steps ``ranks[i]`` had applied when its world lost a rank (a newcomer's
    value is ignored). Every survivor held the same state before the step that failed, and a survivor
    that applied no step past it still holds that state: handing it to everyone leaves the failed step
    applied by no rank, whichever ranks saw their reduction complete. ConfigError for a survivor whose
    count is not a non-negative int, or when every rank is new.
    """
    if len(applied) != len(ranks):
        raise ConfigError(f"applied has {len(applied)} counts for {len(ranks)} ranks: one per rank")
    counts: dict[int, int] = {}
    for rank, count in zip(ranks, applied):
        if rank in newcomers:
            continue
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or int(count) < 0:
            raise ConfigError(f"rank {rank} passed applied={count!r}: every surviving rank passes the number of "
                              "steps it has applied (a non-negative int)")
        counts[rank] = int(count)
    survivors_of(ranks, newcomers)  # ConfigError when every rank is new
    fewest = min(counts.values())
    return tuple(r for r in ranks if counts.get(r) == fewest)


def survivors_of(ranks: Sequence[int], newcomers: Sequence[int]) -> list[int]:
    """The ranks not in ``newcomers``, in order; ConfigError when there are none (nobody holds a state)."""
    survivors = [r for r in ranks if r not in newcomers]
    if not survivors:
        raise ConfigError(f"every rank of {list(ranks)} joined as a new process: no survivor holds the run's "
                          "state to hand over; resume from a checkpoint instead")
    return survivors


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral)
