"""The hand-over of a large state to a rank that joins: speed against the loopback, and the donor's memory.

For each state size (parameters plus Adam's two moments, float32: a third of it parameters) and each
layout, one world over loopback gloo:

* **1 -> 1** (2 ranks): rank 0 holds the state, rank 1 is a fresh process with the model's shape and an
  optimizer without state; ``hand_over(model, opt, counters)``;
* **2 -> 2** (4 ranks): ranks 0 and 2 hold the same state, ranks 1 and 3 are new;
  ``hand_over(..., donors=2, newcomers=[1, 3])``: each donor sends half of the chunks to each newcomer.

In the same world, before the state is built, the reference: the loopback's own speed for one large
buffer, as torch.distributed ``send``/``recv`` (gloo) and as a raw TCP socket pair (``sendall`` /
``recv_into``), pair by pair at the same time (0 -> 1, and 2 -> 3 in the 4-rank world). With
``--naive`` (1 -> 1 only) also the path that encodes the optimizer's state as one object (the donor
copies it whole) after a chunked ``broadcast_params_``.

It prints, per case, the seconds (the best, and the first: a new world's first hand-over, whose
newcomer writes into memory it never had, which on a VM whose host backs memory lazily can cost more
than the transfer), GB/s per newcomer and in all, the ratio to the loopback reference
(the same pairs, in all), the donor's peak memory beyond its state (VmHWM after ``clear_refs``, against
VmRSS before), the newcomer's, and the comparison with torchft's reported 12 GB in about 3 s (4 GB/s).
Each receiver checks every tensor it took against the donor's closed-form values.

    python benchmarks/elastic.py [--gb 1,4] [--layouts 1x1,2x2] [--reps 2] [--chunk-mib 64] [--naive] [--thp]
    (worker: python -m popmesh launch -n N --engine torch benchmarks/elastic.py --worker ...)
"""

from __future__ import annotations

import argparse
import os
import socket
import time

from _common import launch_json, write_result

REFERENCE_BYTES = 1 << 30
TORCHFT_GBPS = 12 / 3  # torchft's README: a 12 GB state handed over in about 3 s
PIECE = 1 << 25  # elements per parameter tensor (128 MiB of float32)


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    """Start VmHWM (peak resident set) over from the current VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(total_bytes: int, holds: bool):
    """Parameters of ``total_bytes / 3`` (float32), and Adam with its two moments set (``holds``) or none."""
    import torch

    numel = total_bytes // 12
    sizes = [PIECE] * (numel // PIECE) + ([numel % PIECE] if numel % PIECE else []) + [1000] * 8  # and biases
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(n)) for n in sizes])
    with torch.no_grad():
        for i, p in enumerate(params):
            p.fill_(i + 1.0 if holds else 0.0)
    opt = torch.optim.Adam(params.parameters(), lr=1e-3, foreach=False)
    if holds:
        for i, p in enumerate(params):
            opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.full_like(p, 0.5 + i),
                            "exp_avg_sq": torch.full_like(p, 0.25 + i)}
    return params, opt


def check_received(params, opt) -> None:
    import torch

    for i, p in enumerate(params):
        state = opt.state[p]
        for t, want in ((p, i + 1.0), (state["exp_avg"], 0.5 + i), (state["exp_avg_sq"], 0.25 + i)):
            if not bool((t == want).all()):
                raise AssertionError(f"tensor {i} differs from the donor's")
        assert float(state["step"]) == 3.0 and isinstance(state["step"], torch.Tensor)


def pairs(size: int) -> list[tuple[int, int]]:
    return [(s, s + 1) for s in range(0, size - 1, 2)]


def reference(world, reps: int) -> dict[str, float]:
    """GB/s in all of the pairs sending one large buffer at once: torch.distributed and a raw socket."""
    import torch
    import torch.distributed as dist

    import popmesh

    n = len(pairs(world.size))
    buf = torch.ones(REFERENCE_BYTES, dtype=torch.uint8)
    sender = world.rank % 2 == 0
    best = {"torch_send_recv": 0.0, "socket": 0.0}
    listener = None
    if not sender:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
    ports = popmesh.all_gather_object(listener.getsockname()[1] if listener else None)
    if sender:
        conn = socket.create_connection(("127.0.0.1", ports[world.rank + 1]))
    else:
        conn, _ = listener.accept()
    view = memoryview(buf.numpy())
    for _ in range(reps):
        popmesh.barrier()
        start = time.perf_counter()
        if sender:
            dist.send(buf, world.rank + 1)
        else:
            dist.recv(buf, world.rank - 1)
        popmesh.barrier()
        seconds = time.perf_counter() - start
        best["torch_send_recv"] = max(best["torch_send_recv"], n * REFERENCE_BYTES / seconds / 1e9)
        popmesh.barrier()
        start = time.perf_counter()
        if sender:
            conn.sendall(view)
        else:
            got = 0
            while got < REFERENCE_BYTES:
                got += conn.recv_into(view[got:])
        popmesh.barrier()
        best["socket"] = max(best["socket"], n * REFERENCE_BYTES / (time.perf_counter() - start) / 1e9)
    conn.close()
    if listener:
        listener.close()
    del view, buf
    return best


def naive_hand_over(params, opt, donor: int) -> None:
    """The state as one object: parameters by chunked broadcasts, the optimizer's tensors encoded whole."""
    import json

    import torch

    import popmesh
    from popmesh.torch import broadcast_params_

    broadcast_params_(params, src=donor)
    mine = popmesh.current_world().rank == donor
    state = opt.state_dict() if mine else None
    tensors = ({f"{k}/{name}": v for k, e in state["state"].items() for name, v in e.items()} if mine else None)
    groups = popmesh.broadcast_object(json.loads(json.dumps(state["param_groups"])) if mine else None, src=donor)
    tensors = popmesh.broadcast_object(tensors, src=donor)
    if not mine:
        loaded: dict[int, dict] = {}
        for key, value in tensors.items():
            k, name = key.split("/", 1)
            loaded.setdefault(int(k), {})[name] = torch.as_tensor(value)
        opt.load_state_dict({"state": loaded, "param_groups": groups})


def worker(opts: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import popmesh
    from popmesh.torch import hand_over

    torch.set_num_threads(1)
    world = popmesh.init(timeout=900)
    total = int(float(opts.gb) * 1e9)
    newcomers = [r for r in range(world.size) if r % 2 == 1]
    donors = [r for r in range(world.size) if r % 2 == 0]
    holds = world.rank in donors
    ref = reference(world, opts.reps)
    params, opt = build(total, holds)
    state_bytes = sum(p.numel() * 12 for p in params)
    rows = []
    paths = ["stream"] + (["naive"] if opts.naive and world.size == 2 else [])
    for path in paths:
        for _ in range(opts.reps):
            if not holds:  # a fresh newcomer each time: no optimizer state yet
                opt = torch.optim.Adam(params.parameters(), lr=1e-3, foreach=False)
            popmesh.barrier()
            base = status("VmRSS")
            reset_peak()
            popmesh.barrier()
            start = time.perf_counter()
            if path == "stream":
                hand_over(params, opt, {"step": 3}, src=0, donors=len(donors), newcomers=newcomers,
                          chunk_bytes=opts.chunk_mib << 20)
            else:
                naive_hand_over(params, opt, 0)
            popmesh.barrier()
            seconds = time.perf_counter() - start
            extra = status("VmHWM") - base
            if not holds:
                check_received(params, opt)
            extras = popmesh.all_gather(np.array([extra], dtype=np.float64))[:, 0]
            taken = 2 * state_bytes / 3  # Adam's two moments: what a newcomer has to allocate whatever the path
            rows.append({"path": path, "seconds": seconds,
                         "donor_extra": max(extras[r] for r in donors),
                         "newcomer_extra": max(extras[r] for r in newcomers) - taken})
    if world.rank == 0:
        write_result({"reference": ref, "rows": rows, "state_bytes": state_bytes, "newcomers": len(newcomers),
                      "donors": len(donors)})
    world.finalize()


def report(gb: float, layout: str, result: dict) -> None:
    ref, state, k = result["reference"], result["state_bytes"], result["newcomers"]
    for path in dict.fromkeys(r["path"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["path"] == path]
        best = min(rows, key=lambda r: r["seconds"])
        each = state / best["seconds"] / 1e9
        total = each * k
        print(f"{gb:4.0f} GB {layout:5} {path:6} {best['seconds']:6.2f} s (first {rows[0]['seconds']:5.2f} s) "
              f"{each:5.2f} GB/s per newcomer, {total:5.2f} in all: x{total / ref['torch_send_recv']:.2f} of torch "
              f"send/recv, x{total / ref['socket']:.2f} of the socket; donor {best['donor_extra'] / 2**20:+.0f} MiB "
              f"({best['donor_extra'] / state:.1%} of its state), newcomer {best['newcomer_extra'] / 2**20:+.0f} MiB "
              f"beyond the optimizer state it takes; x{each / TORCHFT_GBPS:.2f} of torchft's 4 GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", default="1,4", help="state sizes in GB (1e9 bytes), comma-separated")
    parser.add_argument("--layouts", default="1x1,2x2", help="donors x newcomers: 1x1 (2 ranks), 2x2 (4 ranks)")
    parser.add_argument("--reps", type=int, default=2, help="hand-overs per case (the fastest is shown)")
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--naive", action="store_true", help="also the one-object path (1x1 only)")
    parser.add_argument("--thp", action="store_true",
                        help="THP_MEM_ALLOC_ENABLE=1 in the ranks: torch allocates large tensors in 2 MiB pages")
    parser.add_argument("--worker", action="store_true")
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return
    if opts.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    print(f"state = float32 parameters + Adam's two moments; chunks of {opts.chunk_mib} MiB; loopback gloo; "
          f"reference: {REFERENCE_BYTES >> 20} MiB per pair, all pairs at once; best of {opts.reps}"
          f"{'; THP_MEM_ALLOC_ENABLE=1' if opts.thp else ''}")
    for gb in [float(x) for x in opts.gb.split(",")]:
        for layout in opts.layouts.split(","):
            size = {"1x1": 2, "2x2": 4}[layout]
            args = ["--worker", "--gb", str(gb), "--reps", str(opts.reps), "--chunk-mib", str(opts.chunk_mib)]
            result = launch_json(os.path.abspath(__file__), size, "torch", *args, *(["--naive"] if opts.naive else []),
                                 timeout=1800)
            ref = result["reference"]
            print(f"{gb:4.0f} GB {layout:5} loopback reference in all: torch send/recv {ref['torch_send_recv']:.2f} "
                  f"GB/s, socket {ref['socket']:.2f} GB/s")
            report(gb, layout, result)


if __name__ == "__main__":
    main()
