"""Two hosts on this machine for multi-host tests: network namespaces joined by a veth pair.

Each host is a network namespace with its own address on a private link and, for every command
run on it, its own host name (``unshare --uts``) and its own ``/etc/hosts`` (``unshare --mount`` with
a bind mount), so a world spread over the two sees what it would see on two machines: two names,
two addresses, no loopback between them. Needs root, ``ip`` and ``unshare``; :func:`unavailable`
says why not where they are missing, so tests can skip with that reason.

The link uses an address in 10.0.0.0/8 that exists only inside the two namespaces made here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["Host", "TwoHosts", "finish_launchers", "unavailable"]

_SETUP_TIMEOUT_S = 10
# Runs as `sh -c SCRIPT sh NAME HOSTS_FILE CMD...` inside the new UTS and mount namespaces.
_ENTER = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'


def unavailable() -> str | None:
    """Why two namespace hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, unshare --uts --mount)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"multi-host tests need the '{tool}' command (iproute2, util-linux)"
    probe = f"pmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_SETUP_TIMEOUT_S)
    return None


@dataclass(frozen=True)
class Host:
    """One simulated machine: a network namespace, a host name, an address and a hosts file."""

    name: str
    netns: str
    addr: str
    device: str
    hosts_file: Path

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` as run on this host (its namespace, its host name, its /etc/hosts)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--",
                "sh", "-c", _ENTER, "sh", self.name, str(self.hosts_file), *command]

    def start(self, command: Sequence[str], **popen: object) -> subprocess.Popen[str]:
        """Start ``command`` on this host in a new session (so its whole tree can be signalled)."""
        return subprocess.Popen(self.argv(command), text=True, start_new_session=True, **popen)  # type: ignore[call-overload]

    def write_hosts(self, entries: Sequence[tuple[str, str]]) -> None:
        """This host's /etc/hosts: localhost plus ``(address, name)`` lines."""
        lines = ["127.0.0.1 localhost", "::1 localhost", *(f"{addr} {name}" for addr, name in entries)]
        self.hosts_file.write_text("\n".join(lines) + "\n")


class TwoHosts:
    """Two namespace hosts on one /24 link; a context manager that removes everything it made.

    ``names`` chooses each host's /etc/hosts: ``"resolving"``, both names resolve to their link
    addresses; ``"own-loopback"``, a host's own name resolves to 127.0.1.1 (Debian's line) and the
    other's to its address (a cluster whose images carry that line); ``"unresolved"``, the usual
    container or fresh cloud VM: its own name resolves to 127.0.1.1, the other's not at all.
    """

    NAMES = ("resolving", "own-loopback", "unresolved")

    def __init__(self, *, names: str = "resolving", tag: str | None = None) -> None:
        if names not in self.NAMES:
            raise ValueError(f"names={names!r}: choose one of {self.NAMES}")
        tag = tag or f"{os.getpid() % 100000}"
        subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self._dir = Path(tempfile.mkdtemp(prefix="popmesh-hosts-"))
        self.hosts = tuple(
            Host(name=f"pmhost{side}", netns=f"pm{tag}{side}", addr=f"{subnet}.{i + 1}", device=f"pm{tag}{side}",
                 hosts_file=self._dir / f"hosts-{side}")
            for i, side in enumerate("ab")
        )
        self.names = names
        self._made: list[str] = []

    def __enter__(self) -> TwoHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        a, b = self.hosts
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            self._made.append(host.netns)
        _ip("link", "add", a.device, "type", "veth", "peer", "name", b.device)
        for host in self.hosts:
            _ip("link", "set", host.device, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.device)
            _ip("-n", host.netns, "link", "set", host.device, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        for host, other in ((a, b), (b, a)):
            if self.names == "resolving":
                host.write_hosts([(a.addr, a.name), (b.addr, b.name)])
            elif self.names == "own-loopback":
                host.write_hosts([("127.0.1.1", host.name), (other.addr, other.name)])
            else:
                host.write_hosts([("127.0.1.1", host.name)])

    def ssh_standin(self, path: Path) -> Path:
        """Write an executable stand-in for ``ssh`` at ``path``: ``standin [ssh options] HOST COMMAND...``
        runs COMMAND (a remote shell's string, as ssh sends it) on the namespace host named HOST. Give it
        to mpiexec's Hydra as ``-launcher ssh -launcher-exec PATH`` (or HYDRA_LAUNCHER_EXEC)."""
        cases = "\n".join(
            f'  {h.name}) exec {" ".join(shlex.quote(a) for a in h.argv(["sh", "-c"]))} "$*" ;;' for h in self.hosts
        )
        path.write_text(
            "#!/bin/sh\n"
            "# ssh stand-in: skip ssh's options, then run the command on the named network-namespace host\n"
            'while [ $# -gt 0 ]; do case "$1" in -[oplicFJLRD]) shift 2 ;; -*) shift ;; *) break ;; esac; done\n'
            'host="$1"; shift\n'
            f'case "$host" in\n{cases}\nesac\n'
            'echo "ssh stand-in: no host named $host" >&2; exit 255\n'
        )
        path.chmod(0o755)
        return path

    def close(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them (the veth pair goes with them)."""
        for netns in self._made:
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                                  timeout=_SETUP_TIMEOUT_S).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        deadline = time.monotonic() + 5
        for netns in self._made:
            while subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                                 timeout=_SETUP_TIMEOUT_S).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.05)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=_SETUP_TIMEOUT_S)
        self._made.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def finish_launchers(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Each launcher's exit code and output; every one still running at ``timeout`` is killed, with its whole
    session, and the test fails."""
    deadline = time.monotonic() + timeout
    ended = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            pytest.fail(f"a launcher was still running after {timeout} s:\n{out[-3000:]}")
        ended.append((p.returncode, out))
    return ended
