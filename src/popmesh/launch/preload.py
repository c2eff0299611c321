"""The launcher's side of ``--preload``: start the fork server, ask it for ranks, treat them as children.

The server (:mod:`popmesh.launch.forkserver`) imports the modules once; each rank it forks is adopted
by this process (a child subreaper while the server lives), so :class:`ForkedProcess` can wait for it
like ``subprocess.Popen`` does. Ranks forked this way start in tens of milliseconds instead of the
seconds an ``import torch`` takes, which matters for many ranks on few cores and for restarts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO

from popmesh.core.errors import ConfigError, PopmeshError
from popmesh.launch.forkserver import MAX_MESSAGE, close_quietly

__all__ = ["ForkServer", "ForkedProcess", "set_child_subreaper"]

_PR_SET_CHILD_SUBREAPER = 36
_READY_TIMEOUT_S = 120.0  # importing torch on a loaded box takes seconds; a hung import must not hang us
_REPLY_TIMEOUT_S = 30.0


def set_child_subreaper(on: bool) -> bool:
    """Make this process adopt its orphaned descendants (Linux); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


class ForkedProcess:
    """A rank the fork server forked and this process adopted: the part of ``Popen`` the launcher uses."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _child_end(spec: int | None, inherited: int, mode: str, ours: list[int], theirs: list[int]) -> int:
    """The descriptor the rank gets for one of its standard streams (see :meth:`ForkServer.popen`)."""
    if spec is None:
        return inherited
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
        theirs.append(fd)
        return fd
    if spec == subprocess.PIPE and mode == "w":
        read_end, write_end = os.pipe()
        ours.append(read_end)
        theirs.append(write_end)
        return write_end
    if spec < 0:
        raise ValueError(f"a forked rank's {'stdin' if mode == 'r' else 'stdout'} cannot be {spec}: give None, "
                         "DEVNULL, a descriptor, or PIPE for stdout and stderr")
    return spec


def _read_ends(ours: list[int], stdout: int | None, stderr: int | None) -> tuple[int | None, int | None]:
    """Our read ends of the rank's stdout and stderr pipes (None where not piped)."""
    ends = iter(ours)
    out = next(ends) if stdout == subprocess.PIPE else None
    err = next(ends) if stderr == subprocess.PIPE else None
    return out, err


class ForkServer:
    """One fork server for one launch: ``spawn`` a rank, ``close`` at the end."""

    def __init__(self, python: Sequence[str], bootstrap: str, modules: Sequence[str], env: Mapping[str, str]) -> None:
        """Start the server under ``python`` with ``env`` and wait until ``modules`` are imported; it forks
        the command lines ``python -P bootstrap ARGS`` (the launcher's) as if they were started."""
        if not set_child_subreaper(True):
            raise ConfigError("--preload needs Linux (the launcher adopts the forked ranks); leave --preload out")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (kept open for the server's life)
        cmd = [*python, "-P", "-m", "popmesh.launch.forkserver", str(theirs.fileno()), str(os.getpid()), *modules]
        self._proc = subprocess.Popen(cmd, env=dict(env), pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True)
        theirs.close()
        self._modules = list(modules)
        self._prefix = [*python, "-P", bootstrap]
        try:
            self._await_ready()
        except BaseException:
            self.close()
            raise

    def popen(self, cmd: Sequence[str], env: Mapping[str, str], *, stdin: int | None = None,
              stdout: int | None = None, stderr: int | None = None, pass_fds: Sequence[int] = ()) -> ForkedProcess:
        """Fork a rank running ``cmd`` (a ``python -P bootstrap.py ...`` command line) with ``Popen``'s
        meaning of ``stdin``/``stdout``/``stderr``: None this process's own, ``subprocess.PIPE``,
        ``DEVNULL``, ``STDOUT`` (stderr only) or a descriptor."""
        args = self._bootstrap_args(cmd)
        ours: list[int] = []  # our ends of pipes, kept
        theirs: list[int] = []  # descriptors opened here for the rank, closed once it has them
        try:
            in_fd = _child_end(stdin, 0, "r", ours, theirs)
            out_fd = _child_end(stdout, 1, "w", ours, theirs)
            err_fd = out_fd if stderr == subprocess.STDOUT else _child_end(stderr, 2, "w", ours, theirs)
            pid = self._spawn(args, list(cmd), env, [in_fd, out_fd, err_fd], pass_fds)
        except BaseException:
            close_quietly(ours)
            raise
        finally:
            close_quietly(theirs)
        out, err = (None if fd is None else os.fdopen(fd, "rb") for fd in _read_ends(ours, stdout, stderr))
        return ForkedProcess(pid, out, err)

    def _bootstrap_args(self, cmd: Sequence[str]) -> list[str]:
        prefix = self._prefix
        if list(cmd[: len(prefix)]) != prefix:
            raise PopmeshError(f"the fork server runs the bootstrap only ({prefix}), not {list(cmd)}")
        return list(cmd[len(prefix):])

    def _spawn(self, args: list[str], command: list[str], env: Mapping[str, str], stdio: list[int],
               pass_fds: Sequence[int]) -> int:
        request = json.dumps({"argv": args, "command": command, "env": dict(env), "cwd": os.getcwd(),
                              "fds": list(pass_fds)})
        if len(request) > MAX_MESSAGE:
            raise PopmeshError(f"the ranks' environment is too large for the fork server ({len(request)} bytes)")
        try:
            socket.send_fds(self._sock, [request.encode()], [*stdio, *pass_fds])
            reply = self._reply(_REPLY_TIMEOUT_S)
        except OSError as exc:
            raise PopmeshError(f"the fork server of --preload is gone ({exc}); launch without --preload") from exc
        pid = reply.get("pid")
        if not isinstance(pid, int):
            raise PopmeshError(f"the fork server could not start a rank: {reply.get('error')}")
        return pid

    def close(self) -> None:
        """Stop the server (the ranks it forked are ours, not its, and live on) and stop adopting orphans."""
        self._sock.close()
        try:
            self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        set_child_subreaper(False)

    def _await_ready(self) -> None:
        try:
            reply = self._reply(_READY_TIMEOUT_S)
        except (OSError, PopmeshError) as exc:
            if self._proc.poll() is None:  # it hangs in an import: no use waiting longer
                self._proc.kill()
            self._proc.wait()
            self._log.seek(0)
            lines = self._log.read().decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else str(exc)
            raise ConfigError(f"--preload {','.join(self._modules)}: the fork server failed to import them: {why}; "
                              "check the module names, or launch without --preload") from exc
        if not reply.get("ready"):
            raise PopmeshError(f"the fork server answered {reply} instead of ready")

    def _reply(self, timeout: float) -> dict[str, object]:
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except TimeoutError as exc:
            raise PopmeshError(f"the fork server did not answer within {timeout:g} s") from exc
        if not data:
            raise PopmeshError("the fork server exited")
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise PopmeshError(f"the fork server answered {reply!r}")
        return reply
