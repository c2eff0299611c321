"""How rank 0 learns what every agent is doing without making anyone wait.

Every rank sends a small JSON row per iteration to rank 0 with a non-blocking ``isend`` on the
demo's own tag; rank 0 drains whatever has arrived between its own iterations, feeds the live view,
and keeps the history and replacement events for the files written at the end. When rank 0 sees the
target reached (and the run asked to stop there) it tells everyone on a second tag; with checkpoints
the ranks instead agree at each checkpoint (a broadcast from rank 0), so they all stop right after
writing the same one (a checkpoint needs every rank: a rank that stopped earlier would leave the
others waiting in it). While the world is short of a lost rank (:meth:`Reporter.detach`) rows are
kept back and sent once it has re-formed (:meth:`Reporter.reconnect`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from popmesh.comm import messages
from popmesh.comm.collectives import broadcast_object
from popmesh.comm.world import World
from popmesh.core.errors import PeerFailure, PopmeshError
from popmesh.demo.view import PopulationView, describe_event, describe_explore
from popmesh.observe.board import Board

__all__ = ["Reporter", "STATS_TAG", "STOP_TAG"]

STATS_TAG = 901
STOP_TAG = 902


class Reporter:
    """Rank 0 collects rows and events; other ranks stream theirs."""

    def __init__(self, world: World, view: PopulationView | None, target: float, stop_at_target: bool,
                 at_checkpoints: bool = False, board: Board | None = None) -> None:
        self.world, self.view, self.target, self.stop_at_target = world, view, target, stop_at_target
        self.board = board
        self._replaced = 0
        self.at_checkpoints = at_checkpoints
        self._agreed = False
        self.history: list[dict[str, Any]] = []
        self.own: list[dict[str, Any]] = []  # this rank's rows: gathered at the end (see complete_history)
        self.events: list[dict[str, Any]] = []
        self.reached: dict[str, Any] | None = None
        self.sizes: list[int] = [world.size]  # the world sizes this rank saw (elastic worlds grow and shrink)
        self._sends: deque[Any] = deque()
        self._done: set[int] = set()
        self._stop_sent = False
        self._backlog: list[dict[str, Any]] | None = None  # rows kept while detached (None: streaming)
        self._stats = messages.irecv(None, STATS_TAG) if world.is_main and world.size > 1 else None
        self._stop = messages.irecv(0, STOP_TAG) if not world.is_main else None

    def record(self, row: dict[str, Any], event: dict[str, Any] | None) -> None:
        """Report this rank's latest iteration (and replacement, if one happened); log it to this rank's
        TensorBoard run."""
        self._log(row, event)
        self.own.append(row)
        if self.world.is_main:
            self._ingest(row, event)
            self.drain()
            return
        if self._backlog is not None:
            self._backlog.append({"row": row, "event": event})
            return
        self._sends.append(messages.isend({"row": row, "event": event}, 0, STATS_TAG))
        while self._sends and self._sends[0].done():
            self._sends.popleft().wait()

    def _log(self, row: dict[str, Any], event: dict[str, Any] | None) -> None:
        """This rank's scalars, against its env steps: return, speed, hyper-parameters, replacements."""
        if self.board is None:
            return
        self._replaced += event is not None
        step = row["steps"]
        self.board.scalars({"return/mean_last_20": row["mean_return"], "speed/steps_per_s": row["steps_per_s"],
                            "hparams/lr": row["lr"], "hparams/entropy": row.get("ent_coef"),
                            "population/replaced": self._replaced}, step)
        if event is not None:
            text = describe_event(event["rank"], event["donors"], event["weights"], event["strategy"])
            self.board.text("population/replacements",
                            f"iteration {event['iteration']}: {text}{describe_explore(event)}", step)

    def complete_history(self, rows_by_rank: list[list[dict[str, Any]]]) -> None:
        """Rank 0, at the end: add every rank's own rows (gathered) to the streamed history. Rows sent
        while the world re-formed can be lost with the old generation; the streamed ones keep the rows
        of a process that was lost. Each row once, in time order."""
        seen = {(r["rank"], r["iteration"], r["time"]) for r in self.history}
        for rows in rows_by_rank:
            self.history.extend(r for r in rows if (r["rank"], r["iteration"], r["time"]) not in seen)
        self.history.sort(key=lambda r: r["time"])

    def flush(self, timeout: float = 5.0) -> None:
        """Before this rank leaves a generation: wait until rank 0 has its rows (they would be lost with
        the generation otherwise); a lost rank 0 takes them with it."""
        for handle in self._sends:
            try:
                handle.wait(timeout)
            except PopmeshError:
                break
        self._sends.clear()

    def detach(self) -> None:
        """This rank left a generation that lost a rank and trains on alone: keep rows back, and
        touch no message of the world, until :meth:`reconnect`."""
        self.flush()
        self._backlog = []
        self._stats = self._stop = None

    def reconnect(self) -> None:
        """After the world re-formed: post this generation's receives (sends of the old one are gone with
        it); send the rows kept back while detached, and the stop if rank 0 has said it (a rank that had
        not taken it before the loss would never see it)."""
        self._sends.clear()
        self._stats = messages.irecv(None, STATS_TAG) if self.world.is_main and self.world.size > 1 else None
        self._stop = messages.irecv(0, STOP_TAG) if not self.world.is_main else None
        backlog, self._backlog = self._backlog or [], None
        if backlog and not self.world.is_main:
            self._sends.append(messages.isend({"rows": backlog}, 0, STATS_TAG))
        if self.world.is_main and self._stop_sent and not self.at_checkpoints:
            self._sends.extend(messages.isend({"stop": True}, rank, STOP_TAG) for rank in range(1, self.world.size))

    def survival(self, event: dict[str, Any]) -> None:
        """Rank 0: a rank was lost, or rejoined, or (in an elastic world) joined or left for good
        (``event["kind"]``; ``event["rank"]``: the agent's launcher number); shown and kept with the events."""
        self.events.append(event)
        if self.view is None:
            return
        kind, agent = event["kind"], event["rank"]
        if kind == "lost":
            self.view.add_event(f"rank {agent} lost")
        elif kind == "left":
            self.view.leave(agent)
            self.view.add_event(f"rank {agent} left for good: the others go on, a world of {event['world_size']}")
        elif kind == "joined":
            self.view.join(agent)
            seeded = describe_event(agent, event["donors"], event["weights"], "mean")
            self.view.add_event(f"rank {agent} joined, a world of {event['world_size']}: {seeded}"
                                + describe_explore(event))
        else:
            seeded = describe_event(agent, event["donors"], event["weights"], "mean")
            alone = max(event.get("iterations_alone") or [0])
            meanwhile = f" (the others trained on: up to {alone} iterations)" if alone else ""
            self.view.add_event(f"rank {agent} rejoined after {event['downtime_s']:.1f} s: {seeded}" + meanwhile)

    def should_stop(self) -> bool:
        """True once rank 0 has seen the target reached and the run stops there (with checkpoints:
        once :meth:`agree_at_checkpoint` said so)."""
        if self.at_checkpoints:
            return self._agreed
        if self.world.is_main:
            return self._stop_sent
        try:
            if self._stop is None or not self._stop.done():
                return False
            self._stop.wait(1.0)
        except PeerFailure:  # rank 0 was lost: no stop until the world re-forms (reconnect() posts it again)
            self._stop = None
            return False
        return True

    def agree_at_checkpoint(self) -> None:
        """Every rank, right after a checkpoint: stop here if rank 0 has seen the target reached."""
        if self.stop_at_target and self.at_checkpoints:
            self._agreed = bool(broadcast_object(self._stop_sent, src=0, group=self.world))

    def drain(self) -> None:
        """Rank 0: take in every message that has arrived, without blocking."""
        # None once every other rank is lost or re-forming: nothing can come until reconnect()
        self._stats, arrived = messages.take_arrived(self._stats, STATS_TAG, PeerFailure)
        for src, message in arrived:
            if message.get("done"):
                self._done.add(src)
            elif "rows" in message:  # kept back while the world was short of a lost rank
                for kept in message["rows"]:
                    self._ingest(kept["row"], kept.get("event"))
            else:
                self._ingest(message["row"], message.get("event"))

    def finish(self, timeout: float = 120.0) -> None:
        """Non-main ranks: flush sends and say done. Rank 0: wait for everyone's done."""
        if not self.world.is_main:
            self._sends.append(messages.isend({"done": True}, 0, STATS_TAG))
            for handle in self._sends:
                handle.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while len(self._done) < self.world.size - 1 and time.monotonic() < deadline:
            self.drain()
            time.sleep(0.01)
        for handle in self._sends:
            handle.wait(timeout)
        self._stats = None

    def _ingest(self, row: dict[str, Any], event: dict[str, Any] | None) -> None:
        self.history.append(row)
        if self.view is not None:
            self.view.update(row["rank"], steps=row["steps"], steps_per_s=row["steps_per_s"], lr=row["lr"],
                             ent_coef=row.get("ent_coef", math.nan),
                             mean_return=math.nan if row["mean_return"] is None else row["mean_return"])
        if event is not None:
            self.events.append(event)
            if self.view is not None:
                self.view.replaced(event["rank"])
                text = describe_event(event["rank"], event["donors"], event["weights"], event["strategy"])
                if event.get("decided_at") is not None and event["decided_at"] != event["iteration"]:
                    text += f" (decided at iteration {event['decided_at']}, applied at {event['iteration']})"
                self.view.add_event(text + describe_explore(event))
        self._check_target(row)

    def _check_target(self, row: dict[str, Any]) -> None:
        value = row["mean_return"]
        if value is None or value < self.target:
            return
        first = self.reached is None
        if self.reached is None or row["time"] < self.reached["time"]:  # rows kept back by a detached rank come late
            self.reached = {"rank": row["rank"], "agent_steps": row["steps"], "time": row["time"],
                            "iteration": row["iteration"]}
        if first:
            if self.view is not None:
                self.view.add_event(f"rank {row['rank']} reached {self.target:g} after {row['steps']:,} steps")
            if self.stop_at_target and not self._stop_sent:
                # else agreed at the next checkpoint, or (detached) sent by reconnect()
                told = [] if self.at_checkpoints or self._backlog is not None else range(1, self.world.size)
                for rank in told:
                    self._sends.append(messages.isend({"stop": True}, rank, STOP_TAG))
                self._stop_sent = True
