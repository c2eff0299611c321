"""The training-rank side of the replay-buffer service: a local buffer that also feeds its manager.

``add(batch)`` always stores locally; with a manager, every ``remote_every``-th add sends the batches
gathered since the last send (DATA) and handles the SCORE reply, in one of three modes:

* ``sync``: send, wait for the score, return it;
* ``async-score``: collect the *previous* send's score (blocking), send this one, return the
  previous score (one step stale; the first call returns None);
* ``async-comm``: like ``async-score`` but the send itself is non-blocking, so computing overlaps
  with moving the batch.

With ``baseline_filtering`` only rows whose ``reward_key`` is at least the manager's last baseline
are sent; a batch with none is skipped, unless ``baseline_refresh_after`` batches in a row were, in
which case it is sent whole to refresh the baseline. ``drain()`` collects what is outstanding and
sends EXIT; call it once at shutdown on every served agent. A crashed manager surfaces as
PeerFailure or CommTimeout from the call that needed it, never as a hang.

A request the service refused (ERROR: a batch that does not fit the manager's stored rows, a
failing scoring function, a rank the manager does not serve) raises :class:`ServiceError` from the
call that collects its answer: in ``sync`` mode the ``add`` that sent it; in the async modes the
next ``add`` (which still sends its own batch first) or ``drain`` (which still sends EXIT first).
The client stays usable, and the refused rows stay in the local buffer.

A lost manager or coordinator is a PeerFailure that says so, naming the rank. Where the launcher
restarts lost ranks, a script that calls ``world.reform()`` after a PeerFailure then calls
:meth:`ReplayBufferClient.reconnect`: the batch whose score had not arrived is sent again (the
manager stores it once, whatever it had received), so nothing this agent sent is lost.
"""

from __future__ import annotations

import uuid
from typing import Any

from popmesh.buffers.baselines import keep_mask
from popmesh.buffers.protocol import (
    COORDINATOR_TAG,
    METADATA_TAG,
    REQUEST_TAG,
    SCORE_TAG,
    STATS_TAG,
    Message,
    MessageType,
    ServiceError,
    batch_size,
    from_payload,
)
from popmesh.buffers.service import Outgoing, send_outgoing
from popmesh.buffers.store import LocalStore, concat_batches, select_rows, to_numpy
from popmesh.comm import messages
from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError, PeerFailure, PopmeshError
from popmesh.core.timeouts import check_timeout

__all__ = ["ReplayBufferClient", "MODES"]

MODES = ("sync", "async-score", "async-comm")


class ReplayBufferClient:
    """A training rank's buffer, connected to manager ``manager_rank`` (None: local only)."""

    def __init__(self, manager_rank: int | None, *, capacity: int = 1000, remote_every: int = 1, mode: str = "sync",
                 baseline_filtering: bool = False, baseline_refresh_after: int = 10, reward_key: str = "log_rewards",
                 coordinator_rank: int | None = None, group: Comm | None = None, timeout: float | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"mode={mode!r}: use one of {', '.join(MODES)}")
        if remote_every < 1 or baseline_refresh_after < 1:
            raise ConfigError("remote_every and baseline_refresh_after must be >= 1")
        if baseline_filtering and manager_rank is None:
            raise ConfigError("baseline_filtering needs a manager (the baseline comes from it): pass manager_rank")
        self.manager_rank, self.coordinator_rank = manager_rank, coordinator_rank
        self.local = LocalStore(capacity)
        self.mode, self.remote_every = mode, remote_every
        self.baseline_filtering, self.refresh_after, self.reward_key = baseline_filtering, baseline_refresh_after, \
            reward_key
        self.group = group
        self.timeout = None if timeout is None else check_timeout(timeout, what="ReplayBufferClient")
        self.baseline: float | None = None
        self.last_score: dict[str, Any] | None = None
        self.sent = self.skipped = 0
        self._adds = self._skipped_in_row = 0
        self._pending: list[dict[str, Any]] = []
        self._reply: messages.RecvHandle | None = None
        self._sending: messages.SendHandle | None = None
        self._drained = False
        self._seq = 0  # DATA sent so far: the manager answers a resent one again but stores it once
        self._id = uuid.uuid4().hex[:16]  # which client of this rank the seqs count for
        self._unanswered: tuple[dict[str, Any], int] | None = None  # the DATA whose SCORE has not arrived
        self._roles: Any = None  # the Roles it was made from, if any: they say the manager's rank after a re-form

    @classmethod
    def from_context(cls, ctx: Any, **options: Any) -> ReplayBufferClient:
        """The client of this training rank, from the world's :class:`~popmesh.topology.roles.Roles`."""
        if not ctx.is_training_rank():
            raise ConfigError(f"rank {ctx.my_rank} is not a training rank")
        options.setdefault("coordinator_rank", ctx.coordinator_rank)
        options.setdefault("group", ctx.world)
        client = cls(ctx.assigned_buffer, **options)
        client._roles = ctx
        return client

    def add(self, batch: dict[str, Any]) -> dict[str, Any] | None:
        """Store ``batch``; every ``remote_every`` adds, send to the manager. Returns a score or None."""
        if self._drained:
            raise ConfigError("add() after drain(): the manager was told this agent left")
        batch_size(batch)
        self.local.add(batch)
        if self.manager_rank is None:
            return None
        self._pending.append(batch)
        self._adds += 1
        if self._adds % self.remote_every:
            return None
        outgoing = self._filter(concat_batches(self._pending))
        self._pending = []
        if self.mode == "sync":
            return self._collect() if self._send(outgoing, blocking=True) else None
        if self._sending is not None:
            sending, self._sending = self._sending, None
            self._manager_wait(lambda: sending.wait(self.timeout))
        refused: ServiceError | None = None
        try:
            previous = self._collect() if self._reply is not None else None
        except ServiceError as e:  # the previous batch was refused: this one still goes, then the caller hears
            previous, refused = None, e
        self._send(outgoing, blocking=self.mode == "async-score")
        if refused is not None:
            raise refused
        return previous

    def _filter(self, batch: dict[str, Any]) -> dict[str, Any] | None:
        if not self.baseline_filtering or self.baseline is None:
            return batch
        if self.reward_key not in batch:
            raise ConfigError(f"baseline_filtering needs the rewards under {self.reward_key!r} in every batch")
        mask = keep_mask(to_numpy(batch[self.reward_key]), self.baseline)
        if mask.any():
            self._skipped_in_row = 0
            return batch if mask.all() else select_rows(batch, mask)
        self._skipped_in_row += 1
        if self._skipped_in_row >= self.refresh_after:
            self._skipped_in_row = 0
            return batch  # nothing passed for a while: send it whole so the baseline gets refreshed
        self.skipped += 1
        return None

    def _send(self, batch: dict[str, Any] | None, blocking: bool, seq: int | None = None) -> bool:
        if batch is None:
            return False
        assert self.manager_rank is not None
        if seq is None:
            self._seq += 1
            self.sent += 1
        self._unanswered = (batch, self._seq if seq is None else seq)
        self._reply = messages.irecv(self.manager_rank, SCORE_TAG, group=self.group, timeout=self.timeout)
        message = Message(MessageType.DATA, {"rows": batch_size(batch), "seq": self._unanswered[1],
                                             "client": self._id}, batch)
        rank = self.manager_rank
        handle = self._manager_wait(lambda: send_outgoing(Outgoing(rank, REQUEST_TAG, message), self.group,
                                                          self.timeout))
        if blocking:
            self._manager_wait(lambda: handle.wait(self.timeout))
        else:
            self._sending = handle
        return True

    def _manager_wait(self, wait: Any) -> Any:
        """``wait()``, with the loss of the manager said as such."""
        try:
            return wait()
        except PeerFailure as e:
            if self.manager_rank not in e.ranks:
                raise
            world = resolve_group(self.group).world
            if world.elastic and world.newcomer_waiting():
                raise PeerFailure(f"the replay-buffer manager (rank {self.manager_rank}) left this generation of the "
                                  "world, which re-forms (ranks join it, or one left it for good): call "
                                  "world.reform(), then rebuild() the roles and reconnect() this client; its "
                                  "unanswered batch is kept",
                                  e.ranks, exact=e.exact) from e
            raise PeerFailure(f"the replay-buffer manager (rank {self.manager_rank}) was lost: {e}. The batches it "
                              "stored are gone with it; this agent's unanswered batch is kept (after world.reform(), "
                              "reconnect() sends it again)", e.ranks, exact=e.exact) from e

    def reconnect(self) -> dict[str, Any] | None:
        """After ``world.reform()`` (and ``rebuild()`` of the roles it was made from): drop this client's
        traffic of the old generation and send again the batch whose score had not arrived (the manager
        stores it once), to the manager's rank in the new generation (in an elastic world ranks are
        renumbered). In ``sync`` mode its score is returned; in the async modes the next ``add`` collects
        it, as before."""
        self._reply = self._sending = None
        if self._roles is not None:
            self.manager_rank, self.coordinator_rank = self._roles.assigned_buffer, self._roles.coordinator_rank
        if self._unanswered is None or self._drained:
            return None
        batch, seq = self._unanswered
        self._send(batch, blocking=self.mode != "async-comm", seq=seq)
        return self._collect() if self.mode == "sync" else None

    def _collect(self, timeout: float | None = None) -> dict[str, Any]:
        assert self._reply is not None
        reply, self._reply = self._reply, None
        received = self._manager_wait(lambda: reply.wait(timeout or self.timeout))
        self._unanswered = None
        message = _expect(received, MessageType.SCORE, "DATA")
        self.baseline = message.data.get("baseline")
        self.last_score = message.data
        return message.data

    def get_metadata(self, timeout: float | None = None) -> dict[str, Any]:
        """Ask the manager for its METADATA (a blocking round trip on the metadata channel)."""
        rank = self._require(self.manager_rank, "manager")
        reply = messages.irecv(rank, METADATA_TAG, group=self.group, timeout=timeout or self.timeout)

        def ask() -> tuple[int, Any]:
            send_outgoing(Outgoing(rank, REQUEST_TAG, Message(MessageType.GET_METADATA)), self.group,
                          timeout or self.timeout).wait()
            return reply.wait()

        received = self._manager_wait(ask)
        return _expect(received, MessageType.METADATA, "GET_METADATA").data

    def population_stats(self, timeout: float | None = None) -> dict[str, Any]:
        """Ask the coordinator for POPULATION_STATS (before the managers have exited)."""
        rank = self._require(self.coordinator_rank, "coordinator")
        reply = messages.irecv(rank, STATS_TAG, group=self.group, timeout=timeout or self.timeout)
        try:
            send_outgoing(Outgoing(rank, COORDINATOR_TAG, Message(MessageType.GET_POPULATION_STATS)), self.group,
                          timeout or self.timeout).wait()
            received = reply.wait()
        except PeerFailure as e:
            if rank not in e.ranks:
                raise
            raise PeerFailure(f"the replay-buffer coordinator (rank {rank}) was lost: {e}", e.ranks,
                              exact=e.exact) from e
        return _expect(received, MessageType.POPULATION_STATS, "GET_POPULATION_STATS").data

    def drain(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Finish the outstanding send and score, then send EXIT; returns the last score. Idempotent.

        ServiceError (after EXIT is sent) if the manager refused the outstanding batch."""
        if self._drained or self.manager_rank is None:
            self._drained = True
            return self.last_score
        seconds = timeout or self.timeout
        if self._sending is not None:
            sending, self._sending = self._sending, None
            self._manager_wait(lambda: sending.wait(seconds))
        refused: ServiceError | None = None
        if self._reply is not None:
            try:
                self._collect(seconds)
            except ServiceError as e:  # the last batch was refused: still leave, so the manager can finish
                refused = e
        rank = self.manager_rank
        self._manager_wait(lambda: send_outgoing(Outgoing(rank, REQUEST_TAG, Message(MessageType.EXIT)), self.group,
                                                 seconds).wait(seconds))
        self._drained = True
        if refused is not None:
            raise refused
        return self.last_score

    def _require(self, rank: int | None, what: str) -> int:
        if rank is None:
            raise ConfigError(f"this client has no {what}: pass {what}_rank (or build it from_context)")
        resolve_group(self.group).require_member(f"ReplayBufferClient ({what} request)")
        return rank


def _expect(received: tuple[int, Any], kind: MessageType, request: str) -> Message:
    src, payload = received
    message = from_payload(payload)
    if message.type is MessageType.ERROR:
        raise ServiceError(f"rank {src} refused {request}: {message.data.get('error')}", src, request)
    if message.type is not kind:
        raise PopmeshError(f"rank {src} answered {request} with {message.type.value}, expected {kind.value}")
    return message
