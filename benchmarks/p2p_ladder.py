"""Where a 4 B MPI round trip's microseconds go: a ladder from bare mpi4py calls to popmesh.send/recv.

Ping-pong between ranks 0 and 1 of an MPI world, every rung alternating in the same processes (reverse
order every other round; each figure the median of ``--rounds`` rounds of ``--reps`` round trips).
Each rung adds one layer to the one above it, so a layer's cost is the difference of two rungs:

* ``raw``: ``comm.Send/Recv`` into preallocated buffers;
* ``mpi calls``: the calls the transport makes for a small frame (``Isend`` + ``Test``; an ``Improbe``
  spin, ``Get_source``, ``Get_count``, ``np.empty``, ``Recv``) on a ready-made envelope;
* ``+envelope``: the envelope built and checked (``inline_envelope``, ``inline_frame``);
* ``+lock``: the transport's lock around each probe;
* ``p2p noflow``: the transport's ``send/recv`` with flow control switched off in place (its window
  accounting and credit counts replaced by no-ops: a measurement, not a mode popmesh has);
* ``p2p``: the transport's ``send/recv`` (checks, fast-path gates, flow control, held sends);
* ``p2p+codec``: the same with ``encode_message`` and ``decode`` around the frames;
* ``popmesh py``: ``popmesh.send/recv`` (front end: group, timeout, tag and rank checks) on the Python path;

and the C path (:mod:`popmesh.engines.mpi.native`), where it is built:

* ``C calls``: its ``isend`` of a ready-made envelope and its ``probe`` (the MPI calls, the checks and
  the decode in C);
* ``+C framing``: the envelope framed in C for every send (``native.envelope``);
* ``C transport``: the transport's ``send_value/recv_decoded`` (gates, window, credits);
* ``popmesh``: ``popmesh.send/recv`` as it runs (the front end around the C path);
* ``users``: mpi4py's pickle ``comm.send/recv``.

This script reaches into the MPI transport's internals on purpose (its communicator, and the flow
control it switches off); docs/messages.md has its figures.
Run: .venv/bin/python benchmarks/p2p_ladder.py [--reps N] [--rounds N]  (launches its 2-rank world)
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import launch_json, on_python_path, write_result

TAG = 4  # the transport's tag for the p2p rungs (popmesh's own rung uses tag 1)


def _option(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def rungs(world, p2p) -> dict[str, Callable[[], object]]:
    """Every rung's round trip as a function of no arguments (rank 0 sends first, rank 1 replies)."""
    from mpi4py import MPI

    import popmesh
    from popmesh.engines.envelope import inline_envelope, inline_frame
    from popmesh.wire import decode, encode_message

    rank, other = world.rank, world.rank ^ 1
    wcomm, comm, status, lock = MPI.COMM_WORLD, p2p._comm, MPI.Status(), threading.Lock()
    data, buf = np.ones(1, dtype=np.float32), np.ones(1, dtype=np.float32)
    frame = encode_message(data, allow_pickle=False, checksum=p2p.payload_checksum)
    ready = inline_envelope(frame, TAG)

    def pair(send: Callable[[], object], recv: Callable[[], object]) -> Callable[[], object]:
        return (lambda: (send(), recv())) if rank == 0 else (lambda: (recv(), send()))

    def mpi_send(build: bool) -> Callable[[], None]:
        def send() -> None:
            request = comm.Isend(inline_envelope(frame, TAG) if build else ready, other, 2 * TAG)
            if not request.Test():
                request.Wait()
        return send

    def mpi_recv(locked: bool, check: bool) -> Callable[[], object]:
        def recv() -> object:
            while True:
                if locked:
                    with lock:
                        message = comm.Improbe(other, 2 * TAG, status)
                else:
                    message = comm.Improbe(other, 2 * TAG, status)
                if message is not None:
                    break
            status.Get_source()
            env = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            message.Recv(env)
            return inline_frame(env, TAG) if check else env
        return recv

    p2p_send, p2p_recv = (lambda: p2p.send(frame, other, TAG, 60)), (lambda: p2p.recv(other, TAG, 60))
    native, handle = p2p._native, p2p._handle

    popmesh_pair = pair(lambda: popmesh.send(data, other, tag=1), lambda: popmesh.recv(other, tag=1))
    c_rungs: dict[str, Callable[[], object]] = {}
    if native is not None:
        from popmesh.wire.format import NATIVE_DTYPE_CODES

        code = NATIVE_DTYPE_CODES[data.dtype]
        envelope = native.envelope(data, code, TAG, False)[0]

        def c_send(framed: bool) -> Callable[[], None]:
            def send() -> None:
                request = native.isend(handle, native.envelope(data, code, TAG, False)[0] if framed else envelope,
                                       data, code, other, 2 * TAG)
                while request is not None and not request.Test():
                    pass
            return send

        def c_recv() -> object:
            return native.probe(handle, other, 2 * TAG, 0.05, 0.002, 1 << 20)

        c_rungs = {"C calls": pair(c_send(False), c_recv), "+C framing": pair(c_send(True), c_recv),
                   "C transport": pair(lambda: p2p.send_value(data, other, TAG, 60),
                                       lambda: p2p.recv_decoded(other, TAG, 60))}
    return {
        "raw": pair(lambda: wcomm.Send(buf, other), lambda: wcomm.Recv(buf, other)),
        "mpi calls": pair(mpi_send(False), mpi_recv(False, False)),
        "+envelope": pair(mpi_send(True), mpi_recv(False, True)),
        "+lock": pair(mpi_send(True), mpi_recv(True, True)),
        "p2p noflow": pair(p2p_send, p2p_recv),
        "p2p": pair(p2p_send, p2p_recv),
        "p2p+codec": pair(lambda: p2p.send(encode_message(data, allow_pickle=False, checksum=False), other, TAG, 60),
                          lambda: decode(p2p.recv(other, TAG, 60)[1])),
        "popmesh py": on_python_path(p2p, popmesh_pair) if native is not None else popmesh_pair,
        **c_rungs,
        **({"popmesh": popmesh_pair} if native is not None else {}),
        "users": pair(lambda: wcomm.send(data, dest=other, tag=3), lambda: wcomm.recv(source=other, tag=3)),
    }


class FlowSwitch:
    """Switches the transport's flow control off for one rung and back on after it: no window is
    kept or counted meanwhile, on either rank, so the windows resume where they were."""

    def __init__(self, p2p) -> None:
        self.p2p, self.saved = p2p, None

    def set(self, off: bool) -> None:
        p2p = self.p2p
        for name in ("_admit", "_took"):
            p2p.__dict__.pop(name, None)
        if self.saved is not None:
            p2p._windows, self.saved = self.saved, None
        if off:
            p2p._admit, p2p._took = (lambda *args: None), (lambda *args: None)
            self.saved, p2p._windows = p2p._windows, {}


def worker() -> None:
    import popmesh

    world = popmesh.init()
    if world.engine_name != "mpi" or world.size != 2:
        sys.exit("p2p_ladder.py runs on 2 MPI ranks (the driver launches them)")
    from mpi4py import MPI

    p2p = world.engine.p2p()
    fns, switch = rungs(world, p2p), FlowSwitch(p2p)
    reps, rounds = _option("--reps", 2000), _option("--rounds", 7)
    per: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:
            switch.set(name == "p2p noflow")
            for _ in range(50):
                fn()
            MPI.COMM_WORLD.Barrier()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            per[name].append((time.perf_counter() - start) / reps)
    switch.set(False)
    if world.is_main:
        write_result({name: statistics.median(values) for name, values in per.items()})
    popmesh.barrier()
    world.finalize()


def main() -> None:
    result = launch_json(os.path.abspath(__file__), 2, "mpi", "--worker", *sys.argv[1:])
    previous = None
    for name, seconds in result.items():
        if name == "C calls":  # the C path's ladder starts again from raw
            previous = result["raw"]
        step = "" if previous is None or name == "users" else f"{(seconds - previous) * 1e6:+8.2f} us"
        print(f"{name:12} {seconds * 1e6:8.2f} us  {step}")
        previous = seconds if name != "users" else previous
    popmesh = result.get("popmesh", result["popmesh py"])
    python = result["popmesh py"] / result["users"]
    print(f"popmesh/users {popmesh / result['users']:.2f}x, Python path/users {python:.2f}x, "
          f"p2p/(p2p noflow) {result['p2p'] / result['p2p noflow']:.2f}x")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
