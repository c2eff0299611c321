"""The replay-buffer manager: the loop a buffer rank runs to score and keep its agents' batches.

A manager serves a fixed set of training ranks (``RankLayout.assigned_training_ranks``). For each
DATA batch it calls ``scoring_function(batch, store)`` **before** inserting the batch, so novelty is
measured against what the buffer held before (torchgfn inserted first, so a batch was compared with
itself), then inserts it into a bounded FIFO store, and replies SCORE with the score and the current
baseline. GET_METADATA is answered on its own tag. BASELINE_SYNC from the coordinator sets a global
baseline. Each served agent ends with EXIT; once all have, the manager sends EXIT to the coordinator
(if any) and returns after its EXIT_ACK.

A request never ends the loop: whatever it causes (an undecodable or malformed message, a type the
manager does not handle, a rank it does not serve, a batch whose keys, row shapes or dtypes do not
fit the stored rows, a scoring or metadata function that raises or returns what JSON cannot carry)
is answered with an ERROR reply naming the cause, logged and counted, and leaves the manager as it
was: a refused batch is neither scored, stored nor counted. ERROR goes where the sender waits for
the answer: METADATA_TAG for GET_METADATA, SCORE_TAG for everything else.

A lost agent does not end the loop either (a PeerFailure naming served agents only). Where the
launcher restarts lost ranks (``popmesh launch --max-restarts N``: ``World.restarts_lost_ranks``)
the manager re-forms the world with the survivors and keeps its store; the restarted agent is
served again from its first batch. Otherwise the agent is counted lost (``ManagerStats.lost``) and
the others are served on. Each DATA carries its client's id and sequence number, so a batch a client
sends again after a re-form (it never saw the answer) is answered again but stored once. The loss of the
coordinator ends the loop with a PeerFailure that says so.

In an elastic world (``popmesh launch --nnodes MIN:MAX``, ``World.elastic``) the manager also re-forms
when ranks wait to join (it polls ``World.newcomer_waiting()`` between requests) and when a served agent
left for good. It keeps its store, follows the ranks' new numbers, serves the newcomers its roles assign
it, and counts the rows of agents that left (``ManagerStats.left``, by launcher number).

Cross-rank contract: run :meth:`ReplayBufferManager.run` on the manager rank while its agents use
:class:`~popmesh.buffers.client.ReplayBufferClient`; every served agent must eventually call
``drain()`` (which sends EXIT).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popmesh.buffers.baselines import check_strategy, choose_baseline, local_baseline, update_ema
from popmesh.buffers.protocol import (
    COORDINATOR_TAG,
    METADATA_TAG,
    REQUEST_TAG,
    SCORE_TAG,
    Message,
    MessageType,
    ProtocolError,
    batch_size,
    check_message,
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
from popmesh.buffers.store import LocalStore, to_numpy
from popmesh.comm import messages
from popmesh.comm.world import Comm, resolve_group
from popmesh.core import trace
from popmesh.core.errors import CommTimeout, ConfigError, PeerFailure, PopmeshError
from popmesh.core.timeouts import check_timeout, resolve_timeout

__all__ = ["ReplayBufferManager", "ManagerStats", "ScoringFunction", "novelty_score"]

logger = logging.getLogger(__name__)
_AGENT_REQUESTS = (MessageType.DATA, MessageType.GET_METADATA, MessageType.EXIT)
ScoringFunction = Callable[[dict[str, Any], LocalStore], "float | Mapping[str, Any]"]


@dataclass
class ManagerStats:
    """What a manager saw: messages per type, DATA rows per sender, error replies sent, served agents
    lost (rank -> times), batches sent again after a re-form (answered, not stored twice), and in an
    elastic world the rows of served agents that left for good (launcher number -> rows; their ranks
    went to others)."""

    messages: Counter[str] = field(default_factory=Counter)  # MessageType value -> count
    rows_from: Counter[int] = field(default_factory=Counter)  # sender rank -> DATA rows
    errors: int = 0
    lost: Counter[int] = field(default_factory=Counter)  # served rank -> times it was lost
    repeated: int = 0
    left: Counter[int] = field(default_factory=Counter)  # launcher number -> DATA rows, for agents gone for good

    def to_dict(self) -> dict[str, Any]:
        return {"messages": dict(self.messages), "rows_from": {str(k): v for k, v in self.rows_from.items()},
                "errors": self.errors, "lost": {str(k): v for k, v in self.lost.items()}, "repeated": self.repeated,
                "left": {str(k): v for k, v in self.left.items()}}

    def renumber(self, moved: Mapping[int, int], roster: Sequence[int]) -> None:
        """Follow a change of the world's size: ``moved`` maps each old rank still there to its new one;
        the rows of those not there are kept under their launcher number (``roster``: the old one)."""
        for rank in set(self.rows_from) - set(moved):
            self.left[roster[rank]] += self.rows_from[rank]
        self.rows_from, self.lost = Counter(moved_keys(self.rows_from, moved)), Counter(moved_keys(self.lost, moved))


def novelty_score(key: str = "states", block_rows: int = 4096) -> ScoringFunction:
    """Score = mean over the batch's rows of the L2 distance to the nearest stored row of ``key``.

    An empty store scores ``inf`` (everything is new); a batch already stored scores 0.
    """
    def score(batch: dict[str, Any], store: LocalStore) -> float:
        stored = store.column(key)
        new = to_numpy(batch[key]).reshape(batch_size(batch), -1).astype(np.float64)
        if stored is None or len(stored) == 0:
            return math.inf
        old = stored.reshape(len(stored), -1).astype(np.float64)
        nearest = np.full(len(new), np.inf)
        for start in range(0, len(old), block_rows):
            block = old[start:start + block_rows]
            dist = np.sqrt(((new[:, None, :] - block[None, :, :]) ** 2).sum(-1))
            nearest = np.minimum(nearest, dist.min(axis=1))
        return float(nearest.mean())

    return score


def _unscored(batch: dict[str, Any], store: LocalStore) -> float:
    return math.inf


class ReplayBufferManager:
    """Scores, stores and answers for the training ranks in ``served`` (see the module docstring).

    ``scoring_function(batch, store)`` returns a float, or a mapping with ``"score"`` and extra
    JSON-able fields echoed in the SCORE reply; a ``"modes"`` list of strings is also reported to
    the coordinator (MODE_REPORT). ``metadata_function(store)`` adds fields to METADATA replies.
    Baselines: see :mod:`popmesh.buffers.baselines`; rewards are read from ``reward_key``.
    """

    def __init__(self, served: Sequence[int], *, capacity: int = 10000,
                 scoring_function: ScoringFunction | None = None,
                 metadata_function: Callable[[LocalStore], Mapping[str, Any]] | None = None,
                 baseline_strategy: str = "min", baseline_percentile: float = 0.1, baseline_ema_alpha: float = 0.1,
                 store_locally: bool = True, reward_key: str = "log_rewards", coordinator_rank: int | None = None,
                 report_every: int = 1, group: Comm | None = None, timeout: float | None = None) -> None:
        check_strategy(baseline_strategy, baseline_percentile, baseline_ema_alpha)
        if not served:
            raise ConfigError("a manager must serve at least one training rank")
        if report_every < 1:
            raise ConfigError(f"report_every={report_every} must be >= 1")
        self.served = frozenset(int(r) for r in served)
        self.store = LocalStore(capacity)
        self.scoring_function = scoring_function or _unscored
        self.metadata_function = metadata_function
        self.strategy, self.percentile, self.alpha = baseline_strategy, baseline_percentile, baseline_ema_alpha
        self.store_locally, self.reward_key = store_locally, reward_key
        self.coordinator_rank, self.report_every = coordinator_rank, report_every
        self.group = group
        self.timeout = None if timeout is None else check_timeout(timeout, what="ReplayBufferManager")
        self.stats = ManagerStats()
        self.exited: set[int] = set()
        self.gone: set[int] = set()  # served agents lost for good (no restart to wait for)
        self._answered: dict[int, tuple[tuple[Any, Any], dict[str, Any]]] = {}  # rank -> (client, seq), SCORE
        self.roles: Any = None  # the Roles it was made from, if any (rebuilt after a re-form)
        self._ema: float | None = None
        self._synced: float | None = None
        self._data_seen = 0

    @classmethod
    def from_context(cls, ctx: Any, **options: Any) -> ReplayBufferManager:
        """The manager of this buffer rank, from the world's :class:`~popmesh.topology.roles.Roles`."""
        if not ctx.is_buffer_rank():
            raise ConfigError(f"rank {ctx.my_rank} is not a buffer rank: "
                              f"run a manager on {sorted(ctx.buffer_rank_set)}")
        options.setdefault("coordinator_rank", ctx.coordinator_rank)
        options.setdefault("group", ctx.world)
        manager = cls(ctx.assigned_training_ranks, **options)
        manager.roles = ctx  # after a re-form its groups are made again (Roles.rebuild), as every rank does
        return manager

    @property
    def done(self) -> bool:
        """True once every served agent has sent EXIT (or was lost, where lost ranks are not restarted)."""
        return self.exited | self.gone >= self.served

    @property
    def local_baseline(self) -> float | None:
        """This manager's own estimate (ignoring a synced global baseline)."""
        rewards = self.store.column(self.reward_key) if self.store_locally else None
        return local_baseline(self.strategy, rewards, self.store.is_full, self._ema, self.percentile)

    @property
    def baseline(self) -> float | None:
        """The baseline sent to agents: the synced global one if any, else the local one."""
        return choose_baseline(self._synced, self.local_baseline)

    # ---- dispatch (no communication) ---------------------------------------------------------
    def handle(self, src: int, message: Message) -> list[Outgoing]:
        """Apply one request from global rank ``src``; returns the messages to send, each one encodable.

        Never raises for a bad request: the exception it causes becomes an ERROR reply to ``src``
        (see the module docstring), and the manager's state is left as it was.
        """
        self.stats.messages[message.type.value] += 1
        try:
            out = self._dispatch(src, message) if trace.ACTIVE is None else self._traced(src, message)
            for reply in out:
                check_message(reply.message)
            return out
        except Exception as e:  # whatever a request causes is answered, never fatal
            if not isinstance(e, PopmeshError):  # a bug in a user function: keep its traceback in the log
                logger.warning("replay-buffer manager: %s from rank %s raised", message.type.value, src, exc_info=True)
            return [self.error_reply(src, f"{message.type.value} from rank {src} refused: {type(e).__name__}: {e}",
                                     message.type)]

    def _traced(self, src: int, message: Message) -> list[Outgoing]:
        """:meth:`_dispatch` as a span of the trace timeline (only called while tracing)."""
        assert trace.ACTIVE is not None
        with trace.ACTIVE.span(f"buffers.{message.type.value}", "buffers", src=src):
            return self._dispatch(src, message)

    def _dispatch(self, src: int, message: Message) -> list[Outgoing]:
        kind = message.type
        if kind in _AGENT_REQUESTS and src not in self.served:
            return [self.error_reply(src, f"rank {src} sent {kind.value} to a manager that does not serve it (it "
                                          f"serves ranks {sorted(self.served)}): send to the manager assigned to "
                                          "it (Roles.assigned_buffer)", kind)]
        if kind is MessageType.DATA and message.batch is not None:
            sent = (message.data.get("client"), message.data.get("seq"))
            repeat = self._repeat(src, sent)
            return repeat if repeat is not None else self._on_data(src, message.batch, sent)
        if kind is MessageType.GET_METADATA:
            return [Outgoing(src, METADATA_TAG, Message(MessageType.METADATA, self.metadata()))]
        if kind is MessageType.BASELINE_SYNC and src == self.coordinator_rank:
            value = message.data.get("global_baseline")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._synced = float(value)
            return []
        if kind is MessageType.EXIT:
            self.exited.add(src)
            return []
        what = "DATA without a batch" if kind is MessageType.DATA else kind.value
        return [self.error_reply(src, f"a manager does not handle {what} from rank {src}", kind)]

    def error_reply(self, src: int, text: str, request: MessageType | None = None) -> Outgoing:
        """An ERROR reply to ``src``, counted and logged: on METADATA_TAG for a GET_METADATA ``request``,
        else on SCORE_TAG (where an agent waits for the answer to anything else)."""
        self.stats.errors += 1
        logger.warning("replay-buffer manager: %s", text)
        tag = METADATA_TAG if request is MessageType.GET_METADATA else SCORE_TAG
        data = {"error": text} if request is None else {"error": text, "request": request.value}
        return Outgoing(src, tag, Message(MessageType.ERROR, data))

    def metadata(self) -> dict[str, Any]:
        """Fields of a METADATA reply."""
        data = {"stored": len(self.store), "capacity": self.store.capacity, "baseline": self.baseline,
                "rows_received": sum(self.stats.rows_from.values()), "exited": sorted(self.exited)}
        if self.metadata_function is not None:
            data.update(self.metadata_function(self.store))
        return data

    def _repeat(self, src: int, sent: tuple[Any, Any]) -> list[Outgoing] | None:
        """The SCORE again for a DATA already stored: the same client of ``src`` sent a seq it sent
        before (a client resends its last batch after a re-form)."""
        last = self._answered.get(src)
        client, seq = sent
        if last is None or not isinstance(seq, int) or client != last[0][0] or seq > last[0][1]:
            return None
        self.stats.repeated += 1
        return [Outgoing(src, SCORE_TAG, Message(MessageType.SCORE, {**last[1], "repeated": True}))]

    def _on_data(self, src: int, batch: dict[str, Any], sent: tuple[Any, Any] = (None, None)) -> list[Outgoing]:
        """Score ``batch`` and check everything about it first; only then store and count it."""
        rows = batch_size(batch)
        if self.store_locally:
            self.store.check(batch)
        score, extra = _split_score(self.scoring_function(batch, self.store))  # before inserting: novelty vs old
        reports = self._reports(src, extra)
        check_message(Message(MessageType.SCORE, {**extra, "score": score}))
        ema = update_ema(self._ema, to_numpy(batch[self.reward_key]), self.alpha) if self.reward_key in batch \
            else self._ema
        if self.store_locally:  # nothing below can fail on account of the batch
            self.store.add(batch)
        self._ema = ema
        self.stats.rows_from[src] += rows
        self._data_seen += 1
        reply = {**extra, "score": score, "baseline": self.baseline, "stored": len(self.store), "rows": rows}
        if isinstance(sent[1], int):
            self._answered[src] = (sent, reply)
        out = [Outgoing(src, SCORE_TAG, Message(MessageType.SCORE, reply)), *reports]
        if self.coordinator_rank is not None and self._data_seen % self.report_every == 0:
            out.append(Outgoing(self.coordinator_rank, COORDINATOR_TAG,
                                Message(MessageType.BASELINE_REPORT, {"baseline": self.local_baseline})))
        return out

    def _reports(self, src: int, extra: Mapping[str, Any]) -> list[Outgoing]:
        """The MODE_REPORT for the coordinator, if the score found modes (checked before anything is stored)."""
        modes = extra.get("modes")
        if self.coordinator_rank is None or not modes:
            return []
        report = Message(MessageType.MODE_REPORT, {"modes": list(modes), "training_rank": src})
        return [Outgoing(self.coordinator_rank, COORDINATOR_TAG, report)]

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, idle_timeout: float | None = None) -> ManagerStats:
        """Serve requests until every served agent sent EXIT; then tell the coordinator (if any).

        CommTimeout if no request arrives for ``idle_timeout`` seconds (default: the world's
        timeout), naming the agents that have not exited.
        """
        comm = resolve_group(self.group)
        limit = resolve_timeout(idle_timeout, comm.timeout, "idle_timeout", "ReplayBufferManager.run")
        pending: list[tuple[int, messages.SendHandle]] = []
        while not self.done:
            try:
                outs = self._serve_one(comm, limit)
            except PeerFailure as e:
                pending = self._after_loss(comm, e, pending)
                continue
            except WorldChanging:
                pending = self._reform(comm.world)
                continue
            pending += [(out.dst, send_outgoing(out, self.group, self.timeout)) for out in outs]
            pending = [(dst, h) for dst, h in pending if not h.done()]
        if self.coordinator_rank is not None:
            pending.append((self.coordinator_rank, send_outgoing(Outgoing(
                self.coordinator_rank, COORDINATOR_TAG, Message(MessageType.EXIT)), self.group, self.timeout)))
            self._await_exit_ack(limit)
        for _, handle in pending:
            handle.wait(self.timeout)
        return self.stats

    def _after_loss(self, comm: Comm, error: PeerFailure,
                    pending: list[tuple[int, messages.SendHandle]]) -> list[tuple[int, messages.SendHandle]]:
        """A rank was lost while the manager waited for requests. Served agents are a hole, not the
        end: re-form where the launcher restarts them, else serve the others on. The sends still
        pending (to live ranks) after this, or ``error`` again if the manager cannot go on."""
        lost = set(error.ranks)
        if comm.world.elastic and comm.world.newcomer_waiting():  # a rank that left this generation to re-form
            return self._reform(comm.world)
        if self.coordinator_rank in lost:
            raise PeerFailure(f"replay-buffer manager {comm.rank}: its coordinator (rank {self.coordinator_rank}) "
                              f"was lost: {error}", error.ranks, exact=error.exact) from error
        world = comm.world
        if world.restarts_lost_ranks or world.elastic:
            if not world.elastic:  # an elastic world counts a restart at the re-form (a rank left is no loss)
                self.stats.lost.update(lost & self.served)
            logger.warning("replay-buffer manager %s: rank(s) %s lost; re-forming the world", comm.rank, sorted(lost))
            return self._reform(world)
        if not error.exact or not lost <= self.served:
            raise error
        for rank in sorted(lost - self.gone - self.exited):
            self.stats.lost[rank] += 1
            logger.warning("replay-buffer manager %s: agent %s lost; serving the others on", comm.rank, rank)
        self.gone |= lost
        return [(dst, h) for dst, h in pending if dst not in lost]

    def _reform(self, world: Any) -> list[tuple[int, messages.SendHandle]]:
        """Form the world's next generation with the others, keeping the store: restarted agents are new
        processes with new seqs; in an elastic world every rank may have a new number, agents that left
        for good are no longer served and newcomers are. The sends still pending: none (the old
        generation's went with it; a client sends again what was not answered)."""
        before = self.roles.roster if self.roles is not None else ()
        fresh, moved = reform_service(world, self.roles, "ReplayBufferManager.from_context")
        if moved is not None:
            self.served = frozenset(self.roles.assigned_training_ranks or ())
            self.coordinator_rank = self.roles.coordinator_rank
            self.exited, self.gone = moved_ranks(self.exited, moved), moved_ranks(self.gone, moved)
            self._answered = moved_keys(self._answered, moved)
            self.stats.renumber(moved, before)
            for rank in fresh & self.served:  # a restarted process keeps its launcher number; a joined one is new
                if self.roles.roster[rank] in before:
                    self.stats.lost[rank] += 1
        for rank in fresh & self.served:  # restarted or newly joined: a new process, new seqs
            self.exited.discard(rank)
            self._answered.pop(rank, None)
        return []

    def _await_exit_ack(self, limit: float) -> None:
        """Read the coordinator's last messages (baseline syncs) up to its EXIT_ACK, so none is left in flight."""
        assert self.coordinator_rank is not None
        while True:
            _, payload = messages.recv(self.coordinator_rank, REQUEST_TAG, group=self.group, timeout=limit)
            message = from_payload(payload)
            if message.type is MessageType.EXIT_ACK:
                return
            self.handle(self.coordinator_rank, message)

    def _serve_one(self, comm: Comm, limit: float) -> list[Outgoing]:
        try:
            src, payload = next_message(comm, self.group, limit)
        except messages.FrameError as e:
            return [self.error_reply(e.src, f"undecodable request from rank {e.src}: {e}")]
        except CommTimeout as e:
            waiting = sorted(self.served - self.exited)
            raise CommTimeout(f"replay-buffer manager {comm.rank} got no request for {limit:g} s; agents {waiting} "
                              "have not sent EXIT (did they crash, or forget client.drain()?)", tuple(waiting)) from e
        try:
            message = from_payload(payload)
        except ProtocolError as e:
            return [self.error_reply(src, f"malformed request from rank {src}: {e}")]
        return self.handle(src, message)


def _split_score(result: Any) -> tuple[float, dict[str, Any]]:
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ConfigError(f"a scoring function returning a mapping must include 'score'; got keys {list(result)}")
        return float(result["score"]), {k: v for k, v in result.items() if k != "score"}
    return float(result), {}
