"""AsyncSelectiveAveraging: selective averaging where training never waits.

At a decision point each rank snapshots its weights (a copy taken between optimizer steps, so a
donor never streams a tensor the optimizer is modifying) and sends its report (metric, steps) to
the coordinator. By default the coordinator judges that rank at once against every other member's
latest report (the pure :func:`~popmesh.population.judge`); with ``decide="complete"`` it waits
until every member reported the iteration and runs the synchronous policy's pure
:func:`~popmesh.population.decide`. It instructs the ranks involved; donors stream their snapshot;
the replaced rank combines in its background thread, and its main thread swaps the result in at
its next policy call. All of it runs over :mod:`popmesh.comm.messages` on popmesh-internal tags,
from one background thread per rank; no collective is issued from that thread.

Fixes over torchgfn's ``AsyncSelectiveAveragingPolicy``: combined weights are actually applied;
the coordinator (rank 0 by default) may itself donate or be replaced; momentum and the group are
honoured (group ranks, group size); ``weighted_mean`` favours better donors; one decision in
flight per replaced rank, so parameter streams never interleave; shutdown is a handshake with a timeout, and a dead
peer surfaces as PeerFailure/CommTimeout instead of a hang.
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from popmesh.comm.world import Comm, resolve_group
from popmesh.core.errors import ConfigError, PeerFailure, PopmeshError
from popmesh.population.decisions.combine import OptimizerPolicy
from popmesh.population.decisions.hparams import current_values, decode, encode
from popmesh.population.decisions.latest import LatestRules
from popmesh.population.decisions.options import SelectiveOptions, check_metric
from popmesh.population.mechanisms.asynchronous.configure import (
    check_lag,
    check_latest_only,
    latest_rules,
    reference_in,
)
from popmesh.population.mechanisms.asynchronous.coordinator import CoordinatorLink
from popmesh.population.mechanisms.asynchronous.deciders import (
    CompleteDecider,
    Decider,
    LatestDecider,
    ReproducibleDecider,
)
from popmesh.population.mechanisms.asynchronous.protocol import Channels, channels
from popmesh.population.mechanisms.asynchronous.runtime import Runtime, surface
from popmesh.population.mechanisms.asynchronous.trainer import Pending, Snapshot
from popmesh.population.mechanisms.info import Clock, PolicyInfo
from popmesh.population.mechanisms.policy import PopulationPolicy
from popmesh.population.state.model_state import layout_of, model_tensors, optimizer_tensors, snapshot
from popmesh.population.state.replace import apply_replacement

__all__ = ["AsyncSelectiveAveraging"]

_INSTANCES = itertools.count()
DECIDE = ("latest", "complete")


class AsyncSelectiveAveraging(PopulationPolicy):
    """Asynchronous selective averaging (same options as :class:`SelectiveAveraging`), plus:

    * ``decide``: ``"latest"`` (default) judges a rank as soon as it reports at a decision point,
      against the latest report of every other member (:func:`~popmesh.population.judge`), and
      sends that rank's decision at once: nobody waits for the slowest, and at most one decision per
      replaced rank is in flight. ``"complete"`` waits until every member reported the iteration and
      decides for all of them (:func:`~popmesh.population.decide`), torchgfn's protocol.
    * ``latest``: the judge's rules, a :class:`~popmesh.population.LatestRules` or a mapping of its
      fields (``relative_gap``, ``absolute_gap``, ``interval``, ``cooldown``, ``burn_in``,
      ``match_experience``, ``quantile_fraction``, ``max_donors``, ``clock``, ``history``). Unset,
      ``quantile_fraction`` is ``rule``'s ratio and ``max_donors`` is ``donor_rule``'s ``best_k``;
      ``rule`` may then hold only a ratio (at most 0.5) and ``donor_rule`` not be random.
    * ``coordinator``: global rank that decides. Default: the group's first rank, which also trains
      (and may donate or be replaced). A rank outside the group (a topology's coordinator rank)
      must call :meth:`coordinate` with the training group instead of training.
    * ``channel``: which of popmesh's internal tag sets this instance uses; by default instances
      take channels in creation order, so create policies in the same order on every rank.
    * ``poll_interval``: the background thread's longest idle sleep (seconds) on engines that do not
      report arrivals (MPI); on gloo it sleeps until a message arrives.
    * ``lag``: the reproducible mode (``decide="latest"``): decisions in rounds keyed to decision
      iterations, each member judged against every member's report of the round, and applied at
      the replaced rank's call of iteration ``t + lag`` (1 <= lag <= every), which waits for the
      round if it is not resolved yet. Two runs with the same seeds on the same engine then give
      bit-identical decisions, events and weights. Default None: the fast mode, which never waits
      and whose decisions depend on the order reports arrive in (not reproducible).
    * ``reference``: a global rank of the group whose agent is never replaced, compared or a donor
      (``decide="latest"``): it trains alone beside the population, so a run shows what the
      population bought.

    With ``decide="latest"`` and ``explore=Explore(keys=...)``, every report carries the keys'
    values (the optimizer's param-group fields, and the training loop's own passed as ``hparams=``),
    and a replaced agent gets its best donor's values moved by the explore step (Ray PBT's
    perturbation, or PB2's model with ``Explore(pb2=PB2())``), chosen by the coordinator:
    ``info.hparams`` (``{name: [old, new]}``) says what to train at; param-group fields are set.
    A call may pass ``objective=``, what selection ranks by when it is not the training metric
    (an evaluation return, the modes found); ``local_metric`` is then the training metric.

    A replacement decided at iteration ``t`` is applied at a later call of the replaced rank;
    ``info.decision_iteration`` says which. A call may pass ``steps=`` (the experience collected,
    default the iteration): the latest rules compare on it. With ``decide="latest"`` a decision
    point's metric must be finite (a ConfigError names the rank). Cross-rank contract: every rank
    of the group calls the policy with metrics at the same decision iterations (it may get there at
    its own pace) and calls :meth:`shutdown` at the end (also run at exit). Errors of the
    background thread (a dead peer: PeerFailure / CommTimeout) are raised at the next call or at
    shutdown.
    """

    name = "async_selective"

    def __init__(self, every: int, *, decide: str = "latest", latest: LatestRules | Mapping[str, Any] | None = None,
                 coordinator: int | None = None, channel: int | None = None, poll_interval: float = 0.05,
                 reference: int | None = None, lag: int | None = None, **options: Any) -> None:
        self.options = SelectiveOptions.build(every, options, "AsyncSelectiveAveraging")
        if decide not in DECIDE:
            raise ConfigError(f"decide={decide!r}: choose 'latest' (judge each report against the others' latest) "
                              "or 'complete' (wait until every member reported the iteration)")
        self.decide = decide
        self.latest = latest_rules(self.options, latest, set(options)) if decide == "latest" else None
        if decide == "complete" and latest is not None:
            warnings.warn("AsyncSelectiveAveraging: latest= has no effect with decide='complete'", stacklevel=2)
        check_latest_only(decide, reference, self.options.explore)
        self.lag = check_lag(lag, decide, self.options.every)
        self._rounds: list[int] = []  # decision iterations reported, not yet applied (with a lag)
        self._iteration = 0
        self.reference = reference
        self._reference_group: frozenset[int] = frozenset()
        self._hparams_now: dict[str, Any] = {}  # this rank's explored values at its last report
        if coordinator is not None and (isinstance(coordinator, bool) or not isinstance(coordinator, int)
                                        or coordinator < 0):
            raise ConfigError(f"coordinator must be a global rank (int >= 0) or None, got {coordinator!r}")
        if not 0 < float(poll_interval) <= 1.0:
            raise ConfigError(f"poll_interval must be in (0, 1] seconds, got {poll_interval!r}")
        self.coordinator = coordinator
        self.tags: Channels = channels(next(_INSTANCES) if channel is None else channel)
        self.poll_interval = float(poll_interval)
        self._slot: dict[str, Any] = {"runtime": None, "ranks": None}
        self.every, self.events_path = self.options.every, self.options.events_path
        self._closed = False
        self._resumed: dict[str, Any] = {}  # the coordinator's state from a checkpoint
        self._generation = 0  # replacements applied on this rank, reported with every metric
        self._steps: int | None = None
        self._objective: float | None = None
        self._hparams_given: Mapping[str, Any] | None = None
        self._finalizer = weakref.finalize(self, _shutdown_at_exit, self._slot)

    def __call__(self, iteration: int, model: Any, optimizer: Any = None, local_metric: float | None = None,
                 group: Comm | None = None, *, steps: int | None = None, objective: float | None = None,
                 hparams: Mapping[str, Any] | None = None) -> tuple[Any, Any, PolicyInfo]:
        """As every policy's call; ``steps``: this agent's experience so far (env steps; default the
        iteration), reported at decision points for the latest rules' experience matching;
        ``objective``: what selection ranks by (default ``local_metric``); ``hparams``: the current
        values of explored keys that are not optimizer param-group fields (``decide="latest"``)."""
        self._steps = None if steps is None else _count(steps)
        if self.latest is None and (objective is not None or hparams):
            raise ConfigError("objective= and hparams= are read by decide='latest' only; with decide='complete' pass "
                              "what selection ranks by as local_metric, and explore optimizer fields only")
        self._objective, self._hparams_given, self._iteration = objective, hparams, iteration
        return super().__call__(iteration, model, optimizer, local_metric, group)

    def _decider(self, n: int) -> Decider:
        """The coordinator's decision protocol for a group of ``n``."""
        if self.latest is None:
            return CompleteDecider(n, self.options)
        if self.lag is not None:
            return ReproducibleDecider(n, self.options, self.latest, self._reference_group)
        return LatestDecider(n, self.options, self.latest, self._reference_group)

    def _idle(self, group: Comm | None) -> bool:
        """Most calls: nothing to report or swap in. Kept to a few attribute reads, since such a
        call runs cold between training steps (a full call measured ~80 us of CPU there)."""
        runtime = self._slot["runtime"]
        if self._rounds and self._rounds[0] + self.lag <= self._iteration:  # type: ignore[operator]
            return False  # a round is due: apply what it decided, waiting for it if need be
        quiet = runtime is not None and (runtime.quiet() if self.lag is None else runtime.error is None)
        return quiet and group is self._last_group and not self._closed

    def _step(self, comm: Comm, iteration: int, is_due: bool, model: Any, optimizer: Any,
              local_metric: float | None) -> tuple[Any, Any, PolicyInfo]:
        """Swap in a finished replacement, and on decision points report the metric and a snapshot."""
        info = PolicyInfo(iteration, self.name, acted=is_due)
        metric = self._metric(comm, iteration, local_metric) if is_due else math.nan
        runtime = self._runtime(comm)
        surface(runtime.error)
        clock = Clock()
        for pending in self._due(runtime, iteration):
            optimizer = self._apply(comm, pending, model, optimizer, info)
            clock.lap("apply")
        if is_due:
            if self.lag is not None:
                self._rounds.append(iteration)
            steps = iteration if self._steps is None else self._steps
            self._report(runtime, iteration, model, optimizer, metric, steps, self._objective_of(comm, iteration))
            clock.lap("report")
        info.timings = clock.laps
        return model, optimizer, info

    def _metric(self, comm: Comm, iteration: int, local_metric: float | None) -> float:
        """A decision point's metric, checked before anything is sent."""
        metric = check_metric(local_metric, iteration)
        if self.latest is not None and not math.isfinite(metric):
            raise ConfigError(f"rank {comm.rank} reported the metric {metric} at iteration {iteration}: "
                              "decide='latest' judges finite metrics only (pass the last finite value of a "
                              "diverged agent, or use decide='complete', where non-finite means replace first)")
        return metric

    def _due(self, runtime: Runtime, iteration: int) -> list[Pending]:
        """The replacements to apply at this call: any that finished (the fast mode), or what each
        round due by now decided for this rank, waiting for the round to be resolved (a lag)."""
        if self.lag is None:
            pending = runtime.take_pending()
            return [] if pending is None else [pending]
        out = []
        while self._rounds and self._rounds[0] + self.lag <= iteration:
            runtime.wait_round(self._rounds.pop(0), runtime.timeout)
            pending = runtime.take_pending()
            if pending is not None:
                out.append(pending)
        return out

    def _objective_of(self, comm: Comm, iteration: int) -> float:
        """The call's ``objective=`` checked (finite), NaN when not given (selection then ranks by the metric)."""
        if self._objective is None:
            return math.nan
        value = check_metric(self._objective, iteration)
        if not math.isfinite(value):
            raise ConfigError(f"rank {comm.rank} reported the objective {value} at iteration {iteration}: it must be "
                              "finite (pass a diverged agent's last finite value)")
        return value

    def _runtime(self, comm: Comm) -> Runtime:
        if self._closed:
            raise PopmeshError("this AsyncSelectiveAveraging was shut down; create a new policy")
        runtime = self._slot["runtime"]
        if runtime is not None:
            if self._slot["ranks"] != comm.ranks:
                raise ConfigError(f"this policy runs over group {list(self._slot['ranks'])}; create one policy "
                                  f"per group (called with {list(comm.ranks)})")
            return runtime
        coordinator = comm.ranks[0] if self.coordinator is None else self.coordinator
        if not 0 <= coordinator < comm.world.size:
            raise ConfigError(f"coordinator={coordinator} is not a rank of this world of {comm.world.size}")
        self._reference_group = reference_in(self.reference, comm.ranks)
        timeout = comm.timeout if self.options.timeout is None else float(self.options.timeout)
        runtime = Runtime(comm.world, comm.ranks, coordinator, self.tags, self._decider, timeout, self.poll_interval)
        if runtime.coordinator is not None:
            runtime.coordinator.decider.load_state_dict(self._resumed)
        self._slot.update(runtime=runtime, ranks=comm.ranks)
        return runtime

    def state_dict(self) -> dict[str, Any]:
        """What the coordinator's replacement rules remember, as JSON values (on the coordinator's rank;
        empty elsewhere): for a checkpoint. ``decide="complete"`` keeps its selection state (cooldowns,
        ages); ``"latest"`` each member's recent (experience, objective) entries and last replacement,
        so that cooldowns, interval bests and experience matching go on after a resume."""
        runtime = self._slot["runtime"]
        if runtime is not None and runtime.coordinator is not None:
            return runtime.coordinator.decider.state_dict()
        return dict(self._resumed)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`state_dict` before the first call (the coordinator starts from it)."""
        if self._slot["runtime"] is not None:
            raise ConfigError("load_state_dict() must come before the policy's first call")
        self._resumed = {k: v for k, v in state.items() if v is not None}

    def _report(self, runtime: Runtime, iteration: int, model: Any, optimizer: Any, metric: float, steps: int,
                objective: float) -> None:
        explore = self.options.explore
        encoded: Any = ()
        if self.latest is not None and explore is not None:
            self._hparams_now = current_values(explore, optimizer, self._hparams_given)
            encoded = encode(explore, self._hparams_now)
        tensors = model_tensors(model, self.options.include_buffers)
        layout = layout_of(tensors)
        state = optimizer_tensors(optimizer) if self._copies_optimizer(optimizer) else {}
        snap = Snapshot(iteration, snapshot(tensors, layout).buffers, state)
        runtime.post(snap, metric, layout.fingerprint(), steps, self._generation, objective, encoded)

    def _copies_optimizer(self, optimizer: Any) -> bool:
        return self.options.optimizer_policy is OptimizerPolicy.COPY and optimizer is not None

    def _apply(self, comm: Comm, pending: Pending, model: Any, optimizer: Any, info: PolicyInfo) -> Any:
        explore = self.options.explore
        assigned = decode(explore, pending.hparams) if explore is not None and pending.hparams else None
        applied = apply_replacement(self.options, model, optimizer, pending.combined, iteration=info.iteration,
                                    rank=comm.rank, donor_state=pending.donor_state, source=pending.source,
                                    assigned=assigned, previous=self._hparams_now)
        if explore is not None and pending.inherited:
            info.inherited = decode(explore, pending.inherited)
        self._generation += 1
        info.replaced, info.donors, info.weights = True, pending.donors, pending.weights
        info.strategy, info.summary, info.metrics = pending.strategy, pending.summary, pending.metrics
        info.report_iterations = dict(pending.report_iterations)
        info.decision_iteration, info.optimizer, info.hparams = (pending.decision_iteration,
                                                                 applied.optimizer_text, applied.hparams)
        self._log_replacement(comm, info, pending.reason)
        return applied.optimizer

    def shutdown(self, timeout: float | None = None, group: Comm | None = None) -> None:
        """Stop the background thread after a handshake with the coordinator; idempotent.

        Every training rank must call it (or exit, which calls it), also one that never called the
        policy (it stopped before its first decision point): it then takes part in the handshake on
        ``group`` (the group its calls would have used; default the world), so that nobody waits for
        its goodbye. Raises CommTimeout naming what it still waited for after ``timeout`` seconds
        (default: the policy's, else the world's), and any error the background thread met
        (PeerFailure for a dead peer).
        """
        if self._closed:
            return
        runtime = self._slot["runtime"] if self._slot["runtime"] is not None else self._late_runtime(group)
        self._closed = True
        self._finalizer.detach()
        if runtime is None:
            return
        seconds = runtime.timeout if timeout is None else float(timeout)
        runtime.request_shutdown(seconds)
        runtime.join(seconds)
        surface(runtime.error)

    def _late_runtime(self, group: Comm | None) -> Runtime | None:
        """The runtime of a rank that never called the policy, for the shutdown handshake only: None
        where there is nobody to shake hands with (no world, a group of one, this rank outside the
        group, or a member already lost)."""
        try:
            comm = resolve_group(group)
        except PopmeshError:  # no world was formed: nobody to shake hands with
            return None
        if comm.size < 2 or comm.world.rank not in comm.ranks or comm.world.failure(comm.ranks) is not None:
            return None
        return self._runtime(comm)

    def coordinate(self, group: Comm | None = None, timeout: float | None = None) -> int:
        """Run the coordinator for the training ``group`` on this dedicated rank until every training
        rank has shut down; returns the number of decisions dispatched. Not for training ranks."""
        comm = resolve_group(group)
        me = comm.world.rank
        if me in comm.ranks or (self.coordinator is not None and self.coordinator != me):
            raise ConfigError(f"coordinate() runs on the dedicated coordinator rank {self.coordinator}, outside "
                              f"the training group {list(comm.ranks)}; rank {me} should train instead")
        seconds = comm.timeout if timeout is None else float(timeout)
        self._reference_group = reference_in(self.reference, comm.ranks)
        link = CoordinatorLink(comm.world, comm.ranks, self.tags, self._decider(len(comm.ranks)), seconds)
        try:
            _serve(link, self.poll_interval)
        except BaseException as e:
            link.abort(f"{type(e).__name__}: {e}", e.ranks if isinstance(e, PeerFailure) else ())
            raise
        finally:
            link.close()
        return link.decisions


def _count(steps: Any) -> int:
    """``steps`` as an int: a non-negative integer (numpy's too), else a ConfigError."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ConfigError(f"steps must be a non-negative int (the experience collected), got {steps!r}")
    return int(steps)


def _serve(link: CoordinatorLink, poll_interval: float) -> None:
    import time

    pause = 5e-4
    while not link.finished:
        pause = 5e-4 if link.poll() else min(pause * 2, poll_interval)
        time.sleep(pause)
    link.drain(link.timeout)


def _shutdown_at_exit(slot: dict[str, Any]) -> None:
    """Finalizer: the shutdown handshake when the policy is collected or the interpreter exits."""
    runtime = slot.get("runtime")
    if runtime is None or runtime.done.is_set():
        return
    try:
        runtime.request_shutdown(runtime.timeout)
        runtime.join(runtime.timeout)
        surface(runtime.error)
    except Exception as e:
        warnings.warn(f"AsyncSelectiveAveraging shut down with an error: {e}", RuntimeWarning, stacklevel=1)
