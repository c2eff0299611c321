"""``launch()``: start a world of ranks running one script, watch it, and report how it ended.

The CLI (``popmesh launch``) and :func:`popmesh.launch.fork` are thin layers over this function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from popmesh.core.errors import ConfigError
from popmesh.core.interfaces import choose_interface, list_interfaces, source_address
from popmesh.launch import mpirun
from popmesh.launch.hosts import Slots, hydra_hosts, parse_hosts, read_hostfile
from popmesh.launch.inject import RECORD_FILE, FailureInjection, FailureInjector, check_injection
from popmesh.launch.logs import LogRequest, RankLogs, log_request, make_attempt_dir, plan_routes
from popmesh.launch.output import OutputPump, say
from popmesh.launch.plan import (
    LaunchSpec,
    base_env,
    cpu_count,
    is_module_name,
    loopback_env,
    loopback_interface,
    oversubscription_warning,
    plan_mpi_env,
    plan_ranks,
    shared_env,
    validate,
)
from popmesh.launch.preload import ForkServer
from popmesh.launch.rankwatch import RankEnd, RankExit, RankWatch
from popmesh.launch.restarts import Restarts, stop_helper
from popmesh.launch.result import LaunchResult, format_summary
from popmesh.launch.runner import Supervisor
from popmesh.launch.shm import SegmentSweep
from popmesh.launch.timeline import merge_after_exit, trace_env
from popmesh.launch.verdict import judge_local, judge_mpi

__all__ = ["launch", "DEFAULT_GRACE_S", "BOOTSTRAP"]

DEFAULT_GRACE_S = 3.0
# Run by path (``python -P``) so a rank starts without importing the popmesh package.
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")
_PORT_CLASH = ("EADDRINUSE", "address already in use")


def launch(
    target: str,
    args: Sequence[str] = (),
    *,
    nproc: int = 1,
    module: bool = False,
    engine: str = "torch",
    nnodes: int = 1,
    max_nodes: int | None = None,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    quiet_others: bool = False,
    grace: float = DEFAULT_GRACE_S,
    store_fd: bool = True,
    rank0_terminal: bool = False,
    run_id: str | None = None,
    role: str = "default",
    max_restarts: int = 0,
    log_dir: str | None = None,
    tee: int | str | Mapping[int, int] | None = None,
    redirects: int | str | Mapping[int, int] | None = None,
    local_ranks_filter: Collection[int] | None = None,
    hosts: str | Slots = (),
    hostfile: str | None = None,
    env: Mapping[str, str] | None = None,
    trace: str | None = None,
    preload: Sequence[str] = (),
    oversubscription_note: str | None = None,
    inject: FailureInjection | None = None,
    python: Sequence[str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> LaunchResult:
    """Run ``target`` (a script path, or with ``module=True`` a module name) on ``nproc`` local ranks.

    Blocks until every rank has exited. If one fails, the others are sent SIGTERM and, after
    ``grace`` seconds, SIGKILL; a root-cause summary is written to ``stderr`` and the result's
    ``returncode`` is the first failed rank's exit code (128+N for signal N). Call
    ``result.check()`` to turn a failure into :class:`LaunchFailed`. SIGINT/SIGTERM to this
    process are forwarded to the ranks when ``launch`` runs in the main thread. More ranks than the
    launcher's CPU cores start with a warning on ``stderr``, or with ``oversubscription_note`` instead
    for a job that is meant to run that way (``popmesh demo``'s population on a laptop).

    ``env`` adds variables to the ranks' environment; ``trace`` is a folder each rank records its
    timeline into, merged at the end into ``trace/trace.json`` (:mod:`popmesh.launch.timeline`);
    ``preload`` names modules (like ``["torch"]``) that a fork server imports once, forking every local
    rank from it instead of starting a new interpreter (:mod:`popmesh.launch.forkserver`: seconds
    saved per rank and per restart; torch and jax engines); ``python`` is the interpreter command line
    (default ``[sys.executable]``); ``store_fd=False`` stops
    handing rank 0 a pre-bound socket for torch's TCPStore (for scripts that bind ``MASTER_PORT``
    themselves). ``rank0_terminal=True``
    hands rank 0 this process's stdout/stderr directly, unprefixed, so it can draw a live terminal
    view (torch and jax engines; under mpiexec output is always relayed).

    torchrun's settings: ``run_id`` (``TORCHELASTIC_RUN_ID`` and the log folder's prefix; default a new
    uuid when the launcher picks the port, else ``"none"``), ``role`` (``ROLE_NAME``), ``max_restarts``
    (restarts per rank, torch engine; restarts of the whole job on MPI, whose world cannot take one
    rank back), ``log_dir``/``tee``/``redirects`` (per-rank log files, values
    as torchrun's: see :mod:`popmesh.launch.logs`) and ``local_ranks_filter`` (the local ranks whose
    output the console shows). ``inject`` kills random ranks on purpose within the restart budget
    (:mod:`popmesh.launch.inject`).
    """
    spec = LaunchSpec(
        nproc=nproc, engine=engine, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
        master_port=master_port, run_id=_run_id(run_id, master_port), role=role, max_restarts=max_restarts,
        hosts=_hosts(hosts, hostfile, nproc), preload=tuple(preload), max_nodes=max_nodes,
    )
    validate(spec)
    if inject is not None:
        check_injection(inject, spec.engine, spec.max_restarts)
    _check_target(target, module)
    if grace < 0:
        raise ConfigError(f"grace must be >= 0 seconds, got {grace}")
    request = log_request(log_dir, tee, redirects, local_ranks_filter)
    if rank0_terminal and request.routes_output:
        raise ConfigError(
            "rank0_terminal=True hands rank 0 the terminal, so its output cannot also go to log files or a "
            "filter; drop log_dir/tee/redirects/local_ranks_filter, or rank0_terminal"
        )
    python = list(python or [sys.executable])
    worker = [*python, "-P", BOOTSTRAP, *(["-m", target] if module else ["--", target]), *args]
    parent_env = {**os.environ, **(env or {}), **(trace_env(trace) if trace else {})}
    err = stderr or sys.stderr
    crowded = oversubscription_warning(spec.nproc, cpu_count())
    say(err, oversubscription_note if crowded and oversubscription_note else crowded)
    logs = _open_logs(request, spec, err)
    try:
        pump = OutputPump(stdout or sys.stdout, err, quiet_others=quiet_others, sink=logs)
        notes: list[str] = []
        while True:
            result = _supervise(spec, worker, parent_env, pump, grace=grace, store_fd=store_fd, python=python,
                                rank0_terminal=rank0_terminal, logs=logs, err=err, inject=inject,
                                job_restarts=len(notes))
            if not _restart_job(spec, result, len(notes)):
                break
            say(err, format_summary(result))
            notes.append(f"the whole MPI job after {result.failure.describe() if result.failure else 'a failure'}")
            say(err, f"popmesh launch: restarting the whole MPI job ({len(notes)} of {spec.max_restarts}): an MPI "
                      "world cannot take one rank back, so every rank starts again (TORCHELASTIC_RESTART_COUNT="
                      f"{len(notes)}) and resumes from what the script saved")
        if notes:
            result = dataclasses.replace(result, restarts=(*notes, *result.restarts))
    finally:
        if logs is not None:
            logs.close()
        if trace:
            merge_after_exit(trace, err)
    if not result.ok:
        say(err, format_summary(result))
    return result


def _hosts(hosts: str | Slots, hostfile: str | None, nproc: int) -> Slots:
    """The hosts of an MPI world from ``hosts`` or ``hostfile`` (not both); () for one host."""
    if hosts and hostfile:
        raise ConfigError("give the hosts once: --hosts or --hostfile, not both")
    if hostfile:
        return read_hostfile(hostfile, nproc)
    if isinstance(hosts, str):
        return parse_hosts(hosts, nproc) if hosts else ()
    return tuple(hosts)


def _run_id(run_id: str | None, master_port: int) -> str:
    """torchrun's: a new uuid when the launcher picks the port (one node), else ``"none"``, unless given."""
    if run_id is not None:
        return run_id
    return str(uuid.uuid4()) if master_port == 0 else "none"


def _open_logs(request: LogRequest, spec: LaunchSpec, err: TextIO) -> RankLogs | None:
    """The per-rank log files and console filter ``request`` asks for (None: all on the console)."""
    if not request.routes_output:
        return None
    attempt = make_attempt_dir(request.log_dir, spec.run_id) if request.writes_files else None
    ranks = [(spec.node_rank * spec.nproc + local_rank, local_rank) for local_rank in range(spec.nproc)]
    logs = RankLogs(plan_routes(request, attempt, ranks))
    logs.folder = attempt
    if attempt is not None:
        say(err, f"popmesh launch: rank logs in {attempt}")
    return logs


def _restart_job(spec: LaunchSpec, result: LaunchResult, done: int) -> bool:
    """Whether an MPI job that ended so starts again: it failed by itself (not interrupted) and
    ``--max-restarts`` has whole-job restarts left after ``done``."""
    return (spec.engine == "mpi" and not result.ok and result.interrupted_by is None
            and done < spec.max_restarts)


def _supervise(
    spec: LaunchSpec, worker: list[str], parent_env: dict[str, str], pump: OutputPump, *, grace: float,
    store_fd: bool, python: list[str], rank0_terminal: bool = False, logs: RankLogs | None = None,
    err: TextIO = sys.stderr, inject: FailureInjection | None = None, job_restarts: int = 0,
) -> LaunchResult:
    """Start the children, watch them to the end (killing them if we are interrupted), judge.

    Under MPI, the rank watch ends the job when a rank fails where mpiexec does not act (a non-zero exit
    before MPI starts), and the shared-memory segments the job left (a rank died before finalizing) are
    removed once mpiexec has exited. The ranks' error records are copied into their log folders. With
    ``spec.max_restarts`` a failed rank is restarted in place (:class:`Restarts`), and node 0 serves
    the store from a process of its own, so that it outlives any rank; an MPI job is restarted whole by
    :func:`launch` instead, this being its ``job_restarts``-th start. ``inject`` starts the thread that
    kills random ranks within that budget once the ranks are started, stopped before the judgement.
    """
    with tempfile.TemporaryDirectory(prefix="popmesh-launch-") as error_dir:
        supervisor = Supervisor(pump, grace)
        segments = SegmentSweep() if spec.engine == "mpi" else None
        ranks = (RankWatch(error_dir, on_failure=lambda _: supervisor.request_teardown()) if spec.engine == "mpi"
                 else contextlib.nullcontext())
        restarts = Restarts(spec, supervisor, worker, error_dir, err, python[0])
        store: subprocess.Popen[bytes] | None = None
        injector: FailureInjector | None = None
        try:
            with ranks:
                if spec.engine == "mpi":
                    _start_mpi(supervisor, spec, worker, parent_env, error_dir, python[0], job_restarts)
                else:
                    store = _start_local(supervisor, spec, worker, parent_env, error_dir, store_fd, rank0_terminal,
                                         python, restarts)
                    restarts.start_marker()
                    injector = _injector(inject, supervisor, restarts, logs, err)
                supervisor.watch()
        except BaseException:
            supervisor.kill_all()
            raise
        finally:
            if injector is not None:
                injector.stop()
            supervisor.close()
            restarts.close()
            if store is not None:
                stop_helper(store)
            if logs is not None:
                logs.keep_errors(error_dir)
            if segments is not None and supervisor.children:
                segments.sweep(supervisor.children[0].proc.pid)
        killed, exits = (ranks.killed(), ranks.exits()) if isinstance(ranks, RankWatch) else ([], [])
        return _judge(supervisor, spec, error_dir, pump, store_fd, killed, exits, restarts.notes)


def _injector(inject: FailureInjection | None, sup: Supervisor, restarts: Restarts, logs: RankLogs | None,
              err: TextIO) -> FailureInjector | None:
    """``--inject-failures``' thread, started: it picks among the live ranks with a restart left."""
    if inject is None:
        return None

    def candidates() -> dict[int, int]:
        if sup.teardown_at is not None:
            return {}
        return {c.rank: c.proc.pid for c in list(sup.children)
                if c.rank is not None and c.returncode is None and restarts.left(c.rank) > 0}

    folder = None if logs is None or logs.folder is None else Path(logs.folder) / RECORD_FILE
    injector = FailureInjector(inject, candidates, restarts.left, lambda line: say(err, line), folder, restarts.notes)
    injector.start()
    return injector


def _check_target(target: str, module: bool) -> None:
    if module:
        if not is_module_name(target):
            raise ConfigError(f"-m expects a module name like pkg.train, got {target!r}")
    elif not os.path.exists(target):
        raise ConfigError(
            f"script {target!r} not found (cwd {os.getcwd()}); give a path to a .py file or use -m module"
        )


def _start_local(
    sup: Supervisor, spec: LaunchSpec, worker: list[str], parent_env: dict[str, str], error_dir: str, store_fd: bool,
    rank0_terminal: bool = False, python: Sequence[str] = (sys.executable,), restarts: Restarts | None = None,
) -> subprocess.Popen[bytes] | None:
    """Spawn the ranks of this node; rank 0 of node 0 gets the pre-bound store socket (torch), or, with
    restarts, a store process of the launcher does (returned, for the caller to stop). With
    ``spec.preload`` a fork server (the supervisor's, closed with it) forks them instead."""
    sock = None
    store = None
    port = spec.master_port
    if spec.engine == "torch" and (store_fd or spec.serves_store_apart) and spec.hosts_store:
        sock = _listen(spec.master_addr, port, backlog=max(1024, spec.world_size), anywhere=spec.spans_nodes)
        port = sock.getsockname()[1]
    elif port == 0:
        port = _free_port(spec.master_addr)
    try:
        if sock is not None and spec.serves_store_apart:
            store = _serve_store(python[0], sock, spec, port)
            sock.close()
            sock = None
        fd = None if sock is None else sock.fileno()
        common = {**base_env(parent_env, spec, cpu_count()), **loopback_env(parent_env, spec, loopback_interface())}
        common["POPMESH_PARENT_PID"] = str(os.getpid())
        plans = plan_ranks(spec, port, error_dir, store_fd=fd)
        envs = [{**common, **plan.env} for plan in plans]
        if spec.preload:
            sup.forks = ForkServer(python, BOOTSTRAP, spec.preload, shared_env(envs))
        for plan, env in zip(plans, envs):
            gets_fd = "POPMESH_STORE_FD" in plan.env
            inherit = rank0_terminal and plan.rank == 0
            if restarts is not None:
                restarts.remember(plan.rank, env, inherit)
            sup.spawn(worker, env, plan.rank, pass_fds=(fd,) if gets_fd and fd is not None else (),
                      inherit_output=inherit)
            if gets_fd and sock is not None:
                sock.close()  # rank 0 owns it now; our copy would only keep the port busy
                sock = None
    except BaseException:
        if store is not None:
            stop_helper(store)
        raise
    finally:
        if sock is not None:
            sock.close()
    return store


def _serve_store(python: str, sock: socket.socket, spec: LaunchSpec, port: int) -> subprocess.Popen[bytes]:
    """The store process (:mod:`popmesh.engines.torch.store_server`) on ``sock``, leashed to this launcher."""
    leash = [python, "-P", BOOTSTRAP, "--leash", str(int(signal.SIGTERM)), str(os.getpid())]
    serve = [python, "-m", "popmesh.engines.torch.store_server", str(sock.fileno()), spec.master_addr, str(port),
             str(spec.world_size)]
    return subprocess.Popen([*leash, *serve], pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, start_new_session=True)


def _start_mpi(
    sup: Supervisor, spec: LaunchSpec, worker: list[str], parent_env: dict[str, str], error_dir: str, python: str,
    job_restarts: int = 0,
) -> None:
    """One mpiexec for all ranks, on a parent-death leash (the same process, exec'd) so it cannot outlive us.

    On one host Hydra hands its proxy the loopback address (``-iface``, unless ``HYDRA_IFACE`` is set)
    and the netmod listens on loopback only (:func:`loopback_env`); on several (``spec.hosts``) the
    interface that routes to the first other host, so the proxies reach mpiexec whatever this host's
    own name resolves to there.
    """
    mpiexec = mpirun.find_mpiexec(python)
    iface = loopback_interface()
    env = {**base_env(parent_env, spec, cpu_count()), **plan_mpi_env(spec, error_dir, job_restarts),
           **loopback_env(parent_env, spec, iface)}
    hydra_iface = None if "HYDRA_IFACE" in parent_env else _interface_toward(spec.hosts) if spec.hosts else iface
    cmd = mpirun.mpi_command(mpiexec, spec.world_size, worker, hydra=mpirun.is_hydra(mpiexec), iface=hydra_iface,
                             hosts=hydra_hosts(spec.hosts))
    leash = [python, "-P", BOOTSTRAP, "--leash", str(int(signal.SIGTERM)), str(os.getpid())]
    sup.spawn([*leash, *cmd], env, None)


def _interface_toward(hosts: Slots) -> str | None:
    """The interface that routes to the first of ``hosts`` that is not this one (None: leave it to Hydra)."""
    here = {socket.gethostname(), socket.getfqdn(), "localhost"}
    for host, _ in hosts:
        if host not in here:
            choice = choose_interface(host, source_address(host), list_interfaces())
            return None if choice is None else choice.name
    return None


def _family(addr: str) -> socket.AddressFamily:
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve --master-addr {addr!r} ({e}); give a host name or IP that resolves") from e


def _listen(addr: str, port: int, *, backlog: int, anywhere: bool) -> socket.socket:
    """A listening socket for the store; on several nodes it listens on every interface."""
    family = _family(addr)
    host = ("::" if family == socket.AF_INET6 else "0.0.0.0") if anywhere else addr
    try:
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as e:
        raise ConfigError(
            f"cannot listen on {host}:{port} for the rendezvous store ({e.strerror}); "
            "choose a free --master-port, or 0 to let the launcher pick one"
        ) from e


def _free_port(addr: str) -> int:
    """A port that was free a moment ago (for engines whose coordinator binds it itself)."""
    with socket.socket(_family(addr), socket.SOCK_STREAM) as probe:
        probe.bind((addr, 0))
        return probe.getsockname()[1]


def _judge(
    sup: Supervisor, spec: LaunchSpec, error_dir: str, pump: OutputPump, store_fd: bool, killed: list[RankEnd],
    exits: list[RankExit], restarts: list[str],
) -> LaunchResult:
    if spec.engine == "mpi":
        return judge_mpi(sup.children[0], world_size=spec.world_size, error_dir=error_dir, pump=pump,
                         teardown_at=sup.teardown_at, received=sup.received, killed=killed, exits=exits,
                         requested=sup.requested)
    result = judge_local(sup.children, world_size=spec.world_size, engine=spec.engine, error_dir=error_dir,
                         pump=pump, teardown_at=sup.teardown_at, received=sup.received, restarts=restarts)
    if store_fd and spec.engine == "torch" and _mentions_port_clash(result):
        hint = (
            "rank 0 already holds the rendezvous socket (POPMESH_STORE_FD); create torch's TCPStore "
            "with master_listen_fd=int(os.environ['POPMESH_STORE_FD']) (popmesh.init() does) or launch "
            "with --no-store-fd"
        )
        result = dataclasses.replace(result, hints=(hint,))
    return result


def _mentions_port_clash(result: LaunchResult) -> bool:
    failures = [f for f in (result.failure, *result.other_failures) if f is not None]
    texts = [(f.error.traceback if f.error else "") + "\n".join(f.stderr_tail) for f in failures]
    return any(clash in text for text in texts for clash in _PORT_CLASH)
