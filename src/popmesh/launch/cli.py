"""The ``popmesh`` command line: a thin layer of self-registering sub-commands over the Python API.

Built in: ``popmesh launch`` (:func:`popmesh.launch.launch`) and ``popmesh info``. More commands
register themselves with :func:`register_command`, either from code imported before :func:`main`
runs, or from another package through the ``popmesh.commands`` entry-point group, whose entries
point at a :class:`Command` (loaded only when the command line names a command not built in).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from popmesh.core.errors import ConfigError

__all__ = ["Command", "register_command", "commands", "build_parser", "main", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "popmesh.commands"


@dataclass(frozen=True)
class Command:
    """A sub-command: ``configure`` adds its arguments, ``run`` returns the process exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


_COMMANDS: dict[str, Command] = {}


def register_command(command: Command) -> Command:
    """Make ``command`` available as ``popmesh <name>``; registering a name twice replaces it."""
    _COMMANDS[command.name] = command
    return command


def commands() -> dict[str, Command]:
    """The registered commands by name."""
    return dict(_COMMANDS)


def _load_plugins() -> None:
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        loaded = entry.load()
        if isinstance(loaded, Command):
            register_command(loaded)


def _configure_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, default=1, help="ranks on this node (default 1)")
    p.add_argument("--engine", default="torch", help="torch (default), mpi or jax")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    p.add_argument("--master-addr", default="127.0.0.1", help="host of node rank 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port; 0 picks a free one (one node only)")
    p.add_argument("--quiet-others", action="store_true", help="show only rank 0's output")
    p.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL at teardown")
    p.add_argument(
        "--no-store-fd", dest="store_fd", action="store_false",
        help="do not hand rank 0 a pre-bound TCPStore socket (for scripts that bind MASTER_PORT themselves)",
    )
    p.add_argument("-m", "--module", action="store_true", help="run TARGET as a module, like python -m")
    p.add_argument("target", metavar="TARGET", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _run_launch(ns: argparse.Namespace) -> int:
    from popmesh.launch.api import launch

    result = launch(
        ns.target, ns.args, nproc=ns.nproc, module=ns.module, engine=ns.engine, nnodes=ns.nnodes,
        node_rank=ns.node_rank, master_addr=ns.master_addr, master_port=ns.master_port,
        quiet_others=ns.quiet_others, grace=ns.grace, store_fd=ns.store_fd,
    )
    return result.returncode


def _configure_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _run_info(ns: argparse.Namespace) -> int:
    from popmesh.launch.info import collect_info, format_info

    print(format_info(collect_info(), as_json=ns.json))
    return 0


register_command(
    Command("launch", "start N ranks of a script or module and watch them", _configure_launch, _run_launch)
)
register_command(Command("info", "versions, engines and distributed variables", _configure_info, _run_info))


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per registered command."""
    parser = argparse.ArgumentParser(prog="popmesh", description="popmesh: distributed training of learning agents")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS.values():
        command.configure(sub.add_parser(command.name, help=command.help, description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``popmesh ARGS``; returns the exit code (bad configuration exits with 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _COMMANDS:
        _load_plugins()
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _COMMANDS[ns.command].run(ns)
    except ConfigError as e:
        print(f"popmesh {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
