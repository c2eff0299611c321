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

__all__ = [
    "Command", "register_command", "commands", "build_parser", "main", "popmesh_version", "ENTRY_POINT_GROUP"
]

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
    from popmesh.launch.options import configure

    configure(p)
    p.add_argument("--version", action=_Version)


def _run_launch(ns: argparse.Namespace) -> int:
    from popmesh.launch.api import launch
    from popmesh.launch.options import launch_options

    options, warnings = launch_options(ns)
    for warning in warnings:
        print(f"popmesh launch: warning: {warning}", file=sys.stderr)
    return launch(ns.target, ns.args, **options).returncode


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


def popmesh_version() -> str:
    """The installed popmesh's version (from its metadata; "unknown" when run from an uninstalled tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("popmesh")
    except PackageNotFoundError:
        return "unknown"


class _Version(argparse.Action):
    """``--version``: print ``popmesh VERSION`` and exit (the version is looked up only then)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **_: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: str | Sequence[object] | None, option_string: str | None = None,
    ) -> None:
        print(f"popmesh {popmesh_version()}")
        parser.exit()


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="popmesh", description="popmesh: distributed training of learning agents")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers = {}
    for command in _COMMANDS.values():
        # No abbreviations: argparse would take a script's own `--run 3` after the script's name for
        # an abbreviation of `--run-path` (ambiguous option) instead of passing it to the script.
        parsers[command.name] = sub.add_parser(command.name, help=command.help, description=command.help,
                                               allow_abbrev=False)
        command.configure(parsers[command.name])
    return parser, parsers


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per registered command."""
    return _build()[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``popmesh ARGS``; returns the exit code (bad configuration exits with 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _COMMANDS:
        _load_plugins()
    parser, parsers = _build()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's (argparse's default)
        parsers.get(ns.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
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
