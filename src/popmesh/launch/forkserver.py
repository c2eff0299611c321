"""The fork server behind ``popmesh launch --preload``: import heavy modules once, fork every rank.

A rank started as a new process spends seconds importing torch (about 1.5-2 s of CPU each); on a box
with fewer cores than ranks those seconds add up (16 ranks on 2 cores: 16.6 s to a formed world, 1.8 s
when forked). This process imports the named modules once and then, for each request of the launcher
(:mod:`popmesh.launch.preload`), forks a rank that runs the bootstrap exactly as ``bootstrap.py`` would.

Each rank is forked twice (the middle process exits at once) so that it is adopted by the launcher,
which is a child subreaper while it uses a fork server: the launcher then waits for, signals and
judges a forked rank as it does a spawned one. What a forked rank inherits, beyond the modules:

* the environment the modules were imported under: the variables every rank of the node shares (a
  rank's own ones, like ``RANK``, are set before its script runs);
* a fresh Python ``random`` state (CPython reseeds it at fork) and a fresh legacy NumPy global state
  (reseeded here from the OS, as a new process would have it);
* nothing of the server's own descriptors: only its stdin, stdout, stderr and any passed ones.

Protocol (a ``SOCK_SEQPACKET`` socket pair, one message per request): the launcher sends a JSON
object ``{"argv", "command", "env", "cwd", "fds"}`` (``command``: the whole command line the rank
would have been started with, its ``sys.orig_argv``) with the descriptors for stdin, stdout, stderr and then
``fds`` (the numbers they must have in the rank) attached; the server answers ``{"pid": N}`` or
``{"error": text}``. It answers ``{"ready": true}`` once the modules are imported, or exits 1 with
the traceback on stderr.
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import importlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import NoReturn

from popmesh.launch import bootstrap

__all__ = ["main", "close_quietly", "MAX_MESSAGE", "MAX_FDS"]

MAX_MESSAGE = 1 << 20  # bytes of one request (an environment is a few kB)
MAX_FDS = 16
_ADOPTION_WAIT_S = 5.0  # a forked rank waits this long to be adopted by the launcher
_HIGH_FD = 256  # received descriptors are moved above this before they take their numbers


@dataclass(frozen=True)
class _Job:
    """What one forked rank runs: the bootstrap's arguments, its variables, folder and descriptors."""

    argv: list[str]
    command: list[str]  # the rank's sys.orig_argv: as if started, not the server's own
    env: dict[str, str]
    cwd: str
    fds: list[int]  # received: stdin, stdout, stderr, then the passed ones
    targets: list[int]  # the numbers the passed ones must have


def main(argv: list[str] | None = None) -> None:
    """``python -m popmesh.launch.forkserver SOCKET_FD LAUNCHER_PID MODULE...``."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    launcher = int(argv[1])
    bootstrap.die_with_parent(launcher)
    os.environ.pop("POPMESH_PARENT_PID", None)  # as the bootstrap does before a rank's own imports
    try:
        for name in argv[2:]:
            importlib.import_module(name)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    gc.freeze()  # the ranks' collections then skip the server's objects, whose pages they share
    sock.send(json.dumps({"ready": True}).encode())
    job = _serve(sock)
    if job is None:
        return
    _become_rank(job, launcher)
    sys.orig_argv = job.command  # what popmesh.launch.fork() and other re-executing code read
    try:
        bootstrap.main(job.argv)
        status: object = 0
    except SystemExit as exc:
        status = exc.code
    _exit(status)


def _exit(code: object) -> NoReturn:
    """Leave as the interpreter would, without its teardown of every module.

    That teardown writes to nearly every object the server imported, so the kernel copies the pages
    this rank shares with the server: 0.7 s of exit for a rank that preloaded torch. Non-daemon threads
    are joined and atexit hooks run first, in the interpreter's order, and the streams are flushed.
    """
    _join_threads()
    atexit._run_exitfuncs()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # sys.exit("message") prints it, like python
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)


def _join_threads() -> None:
    """Wait for the non-daemon threads as python does at exit: its own shutdown first (which also tells
    ``concurrent.futures`` workers to stop), then any thread it did not know of."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    while True:
        waiting = [t for t in threading.enumerate()
                   if t is not threading.main_thread() and not t.daemon and t.is_alive()]
        if not waiting:
            return
        for thread in waiting:
            thread.join()


def _serve(sock: socket.socket) -> _Job | None:
    """Fork a rank per request until the launcher closes the socket; returns only in a forked rank."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        except ConnectionError:
            return None
        if not data:
            return None
        try:
            request = json.loads(data)
            job = _Job(list(request["argv"]), list(request["command"]), dict(request["env"]), str(request["cwd"]), fds,
                       [int(fd) for fd in request["fds"]])
        except (ValueError, KeyError, TypeError) as exc:
            close_quietly(fds)
            sock.send(json.dumps({"error": f"bad request: {exc}"}).encode())
            continue
        pid = _fork_twice(sock)
        if pid is None:
            return job
        close_quietly(fds)
        sock.send(json.dumps({"pid": pid} if pid > 0 else {"error": "fork failed"}).encode())


def _fork_twice(sock: socket.socket) -> int | None:
    """The rank's pid (-1 if a fork failed); None in the rank itself, whose middle parent has exited."""
    read_end, write_end = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return -1
    if middle == 0:
        os.close(read_end)
        try:
            rank = os.fork()
        except OSError:
            os._exit(1)
        if rank == 0:
            os.close(write_end)
            sock.close()
            return None
        os.write(write_end, str(rank).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read()
    os.waitpid(middle, 0)
    return int(text) if text else -1


def _become_rank(job: _Job, launcher: int) -> None:
    """Take the rank's session, descriptors, variables and folder; wait until the launcher adopts us."""
    os.setsid()
    deadline = time.monotonic() + _ADOPTION_WAIT_S
    while os.getppid() != launcher:
        if time.monotonic() > deadline:
            os.write(2, b"popmesh fork server: the launcher did not adopt this rank (is it a child subreaper?)\n")
            os._exit(1)
        time.sleep(0.0005)
    _place_fds(job.fds, [0, 1, 2, *job.targets])
    os.environ.clear()
    os.environ.update(job.env)
    os.chdir(job.cwd)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh process draws its own seed; a forked one would share the server's


def _place_fds(fds: list[int], targets: list[int]) -> None:
    """Give each received descriptor its target number, inheritable, and close the originals."""
    if len(fds) != len(targets):
        os.write(2, f"popmesh fork server: got {len(fds)} descriptors for {len(targets)} places\n".encode())
        os._exit(1)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HIGH_FD) for fd in fds]
    close_quietly(fds)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)  # the copy is inheritable, like Popen's pass_fds
    close_quietly(high)


def close_quietly(fds: list[int]) -> None:
    """Close each descriptor, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


if __name__ == "__main__":
    main()
