"""``popmesh launch``'s command line: popmesh's options, torchrun's (both spellings) and mpirun's ``-np``.

torchrun's options keep their meaning where it applies (docs/launcher.md maps each one); those that
do not apply are refused with a message naming the option and what to do instead, never ignored.
:func:`configure` adds the options to a parser; :func:`launch_options` turns the parsed namespace
into :func:`popmesh.launch.launch` keyword arguments plus warnings (pure: nothing is started).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from popmesh.core.errors import ConfigError
from popmesh.core.slurm import read_slurm
from popmesh.launch.inject import FailureInjection
from popmesh.launch.plan import cpu_count

__all__ = [
    "configure",
    "launch_options",
    "parse_nproc",
    "parse_preload",
    "parse_nnodes",
    "parse_endpoint",
    "parse_rank_list",
    "Rendezvous",
    "rendezvous",
    "REFUSED",
    "C10D_DEFAULT_PORT",
]

C10D_DEFAULT_PORT = 29400  # torchrun's port for a c10d endpoint given without one
_BACKENDS = ("static", "c10d")

# torchrun options that do not apply to popmesh launch: (option strings, takes a value, why and what instead).
REFUSED: tuple[tuple[tuple[str, ...], bool, str], ...] = (
    (("--no-python", "--no_python"), False,
     "popmesh launch runs Python scripts and modules; start another program from a small Python script"),
    (("--local-addr", "--local_addr"), True,
     "there is no per-node agent to address; name the network with GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME"),
    (("--logs-specs", "--logs_specs"), True,
     "log layouts are not pluggable; use --log-dir with --tee or --redirects (torchrun's default layout)"),
    (("--numa-binding", "--numa_binding"), True,
     "ranks are not bound to NUMA nodes; wrap the launch in numactl or taskset"),
    (("--signals-to-handle", "--signals_to_handle"), True,
     "popmesh launch forwards SIGINT and SIGTERM to every rank (a second one skips --grace); no other signals"),
    (("--virtual-local-rank", "--virtual_local_rank"), False,
     "LOCAL_RANK is always the rank's index on its node; set CUDA_VISIBLE_DEVICES in the script instead"),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True,
     "lines are not duplicated by filter; grep the per-rank logs (--log-dir) instead"),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True,
     "lines are not duplicated by filter; grep the per-rank logs (--log-dir) instead"),
)


def parse_preload(value: str) -> tuple[str, ...]:
    """``--preload torch,numpy`` → ("torch", "numpy"); names are checked with the launch's settings."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


def parse_nproc(value: str) -> int:
    """``-n``: a number of ranks, or torchrun's ``cpu`` (one per core the launcher may use)."""
    text = value.strip()
    if text == "cpu":
        return cpu_count()
    if text in ("gpu", "xpu", "auto"):
        raise argparse.ArgumentTypeError(
            f"{text!r} needs the accelerator count, which popmesh launch does not probe (it imports no "
            "engine); give the number of ranks per node, e.g. -n 8, or 'cpu'"
        )
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of ranks; give e.g. -n 4 (or 'cpu')") from None


def parse_nnodes(value: str) -> tuple[int, int | None]:
    """``--nnodes``: ``N`` (a world of N nodes), or torchrun's ``MIN:MAX``: the world forms on MIN nodes, and
    grows to MAX as later launchers join (``(MIN, MAX)``; ``(N, None)`` where MIN equals MAX)."""
    parts = value.strip().split(":")
    if len(parts) > 2 or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of nodes; give e.g. --nnodes 2 or --nnodes 2:4")
    low, high = int(parts[0]), int(parts[-1])
    if low > high:
        raise argparse.ArgumentTypeError(f"--nnodes {value}: MIN is above MAX; give MIN:MAX like 2:4")
    return low, (high if high != low else None)


def parse_endpoint(value: str, backend: str = "static") -> tuple[str, int]:
    """``--rdzv-endpoint HOST:PORT`` (IPv6 as ``[ADDR]:PORT``) → (host, port), as torchrun reads it.

    Without a port, the c10d backend uses torchrun's 29400; the static one needs a port.
    """
    text = value.strip()
    port_text: str | None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ConfigError(f"--rdzv-endpoint {value!r}: write an IPv6 address as [ADDR]:PORT, like [::1]:29500")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ConfigError(f"--rdzv-endpoint {value!r}: write an IPv6 address in brackets, like [::1]:29500")
    else:
        host, colon, after = text.partition(":")
        port_text = after if colon else None
    if not host:
        raise ConfigError(f"--rdzv-endpoint {value!r} names no host; give HOST:PORT, like node0:29500")
    if port_text is None:
        if backend == "c10d":
            return host, C10D_DEFAULT_PORT
        raise ConfigError(f"--rdzv-endpoint {value!r} has no port; give HOST:PORT, like {host}:29500")
    if not port_text.isdigit() or int(port_text) >= 2**16:
        raise ConfigError(f"--rdzv-endpoint {value!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


def parse_rank_list(value: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1,2`` → the local ranks (None when not given)."""
    if value is None:
        return None
    try:
        ranks = frozenset(int(item) for item in value.split(",") if item.strip())
    except ValueError:
        ranks = frozenset()
    if not ranks or min(ranks) < 0:
        raise ConfigError(f"--local-ranks-filter {value!r} must list local ranks, like 0,1,2")
    return ranks


@dataclass(frozen=True)
class Rendezvous:
    """Where the world meets, resolved from ``--master-*``, ``--rdzv-*`` and ``--standalone``."""

    master_addr: str = "127.0.0.1"
    master_port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    run_id: str | None = None
    max_nodes: int | None = None


def rendezvous(ns: argparse.Namespace) -> tuple[Rendezvous, list[str]]:
    """The rendezvous the options describe, and warnings for settings that ``--standalone`` overrides."""
    if ns.rdzv_backend not in _BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {ns.rdzv_backend!r} is not supported: popmesh launch meets at the TCP store of node "
            "rank 0 (what torchrun's static and c10d backends use); give --rdzv-backend static or c10d"
        )
    if ns.standalone:
        return _standalone(ns)
    slurm = _slurm_nodes(ns)
    if slurm is not None:
        return slurm, []
    nnodes, max_nodes = (1, None) if ns.nnodes is None else ns.nnodes
    addr, port = _strip_brackets(ns.master_addr), ns.master_port
    if ns.rdzv_endpoint is not None:
        host, endpoint_port = parse_endpoint(ns.rdzv_endpoint, ns.rdzv_backend)
        for option, given, wanted in (("--master-addr", addr, host), ("--master-port", port, endpoint_port)):
            if given is not None and given != wanted:
                raise ConfigError(
                    f"{option} {given} disagrees with --rdzv-endpoint {ns.rdzv_endpoint}; give one of them"
                )
        addr, port = host, endpoint_port
    node_rank = ns.node_rank
    if node_rank is None and ((ns.rdzv_backend == "c10d" and nnodes > 1) or max_nodes is not None):
        raise ConfigError(
            "popmesh launch does not hand out node ranks at the rendezvous; give each node its --node-rank (0 to "
            "--nnodes minus one; with MIN:MAX, nodes MIN to MAX-1 join the running world)"
        )
    return Rendezvous(addr or "127.0.0.1", port or 0, nnodes, node_rank or 0, ns.rdzv_id, max_nodes), []


def _slurm_nodes(ns: argparse.Namespace) -> Rendezvous | None:
    """Under ``srun`` (one launcher per node: ``srun --ntasks-per-node=1 popmesh launch -n 4 ...``), with
    no ``--nnodes``/``--node-rank``/``--master-*``/``--rdzv-endpoint`` given, the step's tasks are the
    nodes: SLURM_NTASKS of them, this one SLURM_PROCID, meeting on the step's first node."""
    if ns.nnodes is not None or ns.node_rank is not None or ns.master_addr or ns.master_port or ns.rdzv_endpoint:
        return None
    if os.environ.get("RANK") or os.environ.get("WORLD_SIZE"):
        return None  # inside a world already (a launcher under a launcher): no node layout from Slurm
    task = read_slurm(os.environ)
    if task is None or task.world_size < 2:
        return None
    variables = task.torch_variables(os.environ)
    return Rendezvous(variables["MASTER_ADDR"], int(variables["MASTER_PORT"]), task.world_size, task.rank,
                      ns.rdzv_id or f"slurm-{task.job_id}")


def _standalone(ns: argparse.Namespace) -> tuple[Rendezvous, list[str]]:
    """torchrun's ``--standalone``: one node, a free port on loopback, a new run id."""
    if ns.nnodes not in (None, (1, None)):
        low, high = ns.nnodes
        raise ConfigError(f"--standalone is one node, but --nnodes is {low if high is None else f'{low}:{high}'}; "
                          "drop one of them")
    ignored = [
        f"{option} {value}" for option, value in (
            ("--master-addr", ns.master_addr), ("--master-port", ns.master_port),
            ("--rdzv-endpoint", ns.rdzv_endpoint), ("--rdzv-id", ns.rdzv_id),
        ) if value is not None
    ]
    if not ignored:
        return Rendezvous(node_rank=ns.node_rank or 0), []
    one = len(ignored) == 1
    warning = (
        f"--standalone picks a free port on loopback and a new run id, so {', '.join(ignored)} "
        f"{'is' if one else 'are'} ignored (as torchrun does); drop {'it' if one else 'them'}"
    )
    return Rendezvous(node_rank=ns.node_rank or 0), [warning]


def _strip_brackets(addr: str | None) -> str | None:
    """torchrun writes an IPv6 --master-addr in brackets; the socket layer wants it bare."""
    if addr is not None and addr.startswith("[") and addr.endswith("]"):
        return addr[1:-1]
    return addr


def launch_options(ns: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments for :func:`popmesh.launch.launch` (besides target and args), and warnings."""
    rdzv, warnings = rendezvous(ns)
    if ns.run_path and ns.module:
        raise ConfigError("--run-path runs a script by its path; drop -m, or drop --run-path to run a module")
    if ns.event_log_handler != "null":
        raise ConfigError(
            f"--event-log-handler {ns.event_log_handler!r}: popmesh launch emits no torchelastic events; "
            "leave it out (its failure summary names the rank that failed first)"
        )
    if ns.rdzv_conf:
        raise ConfigError(
            f"--rdzv-conf {ns.rdzv_conf!r}: popmesh's rendezvous has no settings besides its timeout; leave it "
            "out and set POPMESH_TIMEOUT (seconds) for how long ranks wait for each other"
        )
    if ns.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval {ns.monitor_interval} must be > 0 seconds")
    kwargs: dict[str, Any] = dict(
        nproc=ns.nproc, module=ns.module, engine=ns.engine, nnodes=rdzv.nnodes, max_nodes=rdzv.max_nodes,
        node_rank=rdzv.node_rank,
        master_addr=rdzv.master_addr, master_port=rdzv.master_port, run_id=rdzv.run_id, role=ns.role,
        max_restarts=ns.max_restarts, quiet_others=ns.quiet_others, grace=ns.grace, store_fd=ns.store_fd,
        log_dir=ns.log_dir, tee=ns.tee, redirects=ns.redirects,
        local_ranks_filter=parse_rank_list(ns.local_ranks_filter), hosts=ns.hosts or (), hostfile=ns.hostfile,
        trace=ns.trace, preload=parse_preload(ns.preload), inject=injection(ns),
    )
    return kwargs, warnings


def configure(p: argparse.ArgumentParser) -> None:
    """Add every option of ``popmesh launch`` to ``p``."""
    p.add_argument("-n", "-np", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=parse_nproc, default=1,
                   metavar="N", help="ranks on this node (default 1; 'cpu': one per core)")
    p.add_argument("--engine", default="torch", help="torch (default), mpi or jax")
    p.add_argument("--quiet-others", action="store_true", help="show only rank 0's output")
    p.add_argument("--grace", "--shutdown-timeout", "--shutdown_timeout", type=float, default=3.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL at teardown (default 3)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="record every rank's timeline into DIR; merged into DIR/trace.json (open it in "
                        "https://ui.perfetto.dev)")
    p.add_argument("--preload", default="", metavar="MODULES",
                   help="import these modules (like torch,numpy) once in a fork server and fork every rank from "
                        "it: seconds saved per rank and per restart (torch and jax engines)")
    p.add_argument(
        "--no-store-fd", dest="store_fd", action="store_false",
        help="do not hand rank 0 a pre-bound TCPStore socket (for scripts that bind MASTER_PORT themselves)",
    )
    _rendezvous_options(p)
    _output_options(p)
    _injection_options(p)
    _accepted_options(p)
    for names, takes_value, reason in REFUSED:
        p.add_argument(*names, action=_refusal(reason), nargs=None if takes_value else 0, help=argparse.SUPPRESS)
    p.add_argument("-m", "--module", action="store_true", help="run TARGET as a module, like python -m")
    p.add_argument("target", metavar="TARGET", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _injection_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("failure injection (test that a script survives a lost rank; needs --max-restarts)")
    g.add_argument("--inject-failures", type=float, default=None, metavar="PER_MINUTE",
                   help="SIGKILL a random rank that has a restart left, on average this many times a minute; "
                        "each kill goes to stderr and to failures.jsonl in the --log-dir folder")
    g.add_argument("--inject-after", type=float, default=10.0, metavar="S",
                   help="seconds before the first kill may come (default 10)")
    g.add_argument("--inject-seed", type=int, default=0, help="seed of the kills' times and ranks (default 0)")
    g.add_argument("--inject-max", type=int, default=None, metavar="N",
                   help="inject at most N kills (default: as many as the restart budget allows)")


def injection(ns: argparse.Namespace) -> FailureInjection | None:
    """The ``--inject-*`` options as a :class:`FailureInjection` (None without ``--inject-failures``)."""
    if ns.inject_failures is None:
        for flag, value, default in (("--inject-after", ns.inject_after, 10.0), ("--inject-seed", ns.inject_seed, 0),
                                     ("--inject-max", ns.inject_max, None)):
            if value != default:
                raise ConfigError(f"{flag} shapes --inject-failures, which is not given: add --inject-failures "
                                  f"PER_MINUTE, or leave {flag} out")
        return None
    return FailureInjection(ns.inject_failures, seed=ns.inject_seed, after_s=ns.inject_after, limit=ns.inject_max)


def _rendezvous_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("nodes and rendezvous (torchrun's options)")
    g.add_argument("--nnodes", type=parse_nnodes, default=None,
                   help="number of nodes (default 1; under srun, one node per task of the step)")
    g.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's index, 0..nnodes-1")
    g.add_argument("--master-addr", "--master_addr", default=None, help="host of node rank 0 (default 127.0.0.1)")
    g.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="rendezvous port; default: a free one (one node only)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
                   help="master address and port in one")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default="static",
                   help="static (default) or c10d: both meet at node rank 0's store")
    g.add_argument("--rdzv-id", "--rdzv_id", default=None, help="the job's id: TORCHELASTIC_RUN_ID, log folder prefix")
    g.add_argument("--rdzv-conf", "--rdzv_conf", default="", help=argparse.SUPPRESS)
    g.add_argument("--standalone", action="store_true", help="one node, a free port on loopback")
    h = p.add_argument_group("hosts of an MPI world (--engine mpi: one mpiexec starts every host's ranks over ssh)")
    h.add_argument("--hosts", "-hosts", default=None, metavar="A:N,B:N",
                   help="hosts and their ranks, e.g. a:2,b:2 (a host without :N runs -n ranks)")
    h.add_argument("--hostfile", "-f", "--host-file", default=None, metavar="FILE",
                   help="a file of hosts, one a line: host:N or host slots=N")


def _output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output and logs (torchrun's options)")
    g.add_argument("--log-dir", "--log_dir", default=None, metavar="DIR",
                   help="per-rank log files in DIR/<run id>_*/attempt_0/<local rank>/ (tees both streams "
                        "unless --tee or --redirects says otherwise)")
    g.add_argument("-t", "--tee", default=None, metavar="STD",
                   help="streams to write to the log and the console: 0 none, 1 stdout, 2 stderr, 3 both; "
                        "or per local rank, like 0:3,1:2")
    g.add_argument("-r", "--redirects", default=None, metavar="STD",
                   help="streams to write to the log only (values as --tee)")
    g.add_argument("--local-ranks-filter", "--local_ranks_filter", default=None, metavar="RANKS",
                   help="show only these local ranks' output on the console, like 0,1")


def _accepted_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("other torchrun options")
    g.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restarts per rank after a failure, the others running on (torch engine); restarts of the "
                        "whole job, which resumes from its checkpoint (mpi engine); default 0")
    g.add_argument("--role", default="default", help="ROLE_NAME of the ranks (default 'default')")
    g.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1, metavar="S",
                   help="accepted; popmesh sees a rank's exit at once, whatever the interval")
    g.add_argument("--start-method", "--start_method", choices=("spawn", "fork", "forkserver"), default="spawn",
                   help="accepted; as with torchrun, a script always starts as a new process")
    g.add_argument("--run-path", "--run_path", action="store_true",
                   help="accepted; every rank runs the script through runpy.run_path anyway")
    g.add_argument("--event-log-handler", "--event_log_handler", default="null", help=argparse.SUPPRESS)


def _refusal(reason: str) -> type[argparse.Action]:
    """An argparse action that stops parsing with ``popmesh launch``'s usage and ``reason``."""

    class Refuse(argparse.Action):
        def __call__(
            self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
            values: str | Sequence[Any] | None, option_string: str | None = None,
        ) -> None:
            raise argparse.ArgumentError(self, f"torchrun's option is not supported: {reason}")

    return Refuse
