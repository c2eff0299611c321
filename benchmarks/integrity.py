"""Integrity run: thousands of random point-to-point messages, every one checked bit for bit.

Every rank derives the same schedule from one seed: message i goes from a random sender to a
random receiver on a random tag, with a random payload (0 B to 64 MB, every numpy and torch dtype,
strided and empty arrays, 0-d arrays, raw bytes, nested dicts). Senders start their messages with
``isend`` and receivers post ``irecv`` for theirs, round by round, and each rank then waits on its
handles in a random order (sends and receives mixed: MPI's progress rule must carry every order).
A receiver rebuilds each expected payload from the message's seed and compares it exactly.

    python benchmarks/integrity.py                     # 10,000 messages, torch and MPI, 3 ranks
    python benchmarks/integrity.py --burners 2         # the same beside two CPU-bound processes
    python benchmarks/integrity.py --messages 2000 --engines mpi

Prints, per engine, messages and bytes checked, wrong or lost messages (must be 0) and the wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from _common import launch_json, write_result

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"]
TORCH_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
ROUND_NBYTES = 96 << 20  # payload bytes in flight per round, all ranks together


def _nbytes(rng: np.random.Generator) -> int:
    """Mostly small, sometimes large, rarely up to 64 MB; the engines' inline and segment limits included."""
    roll = rng.random()
    if roll < 0.05:
        return 0
    if roll < 0.70:
        return int(rng.integers(1, 4096))
    if roll < 0.92:
        return int(rng.choice([65_535, 65_536, 65_537, 524_092, 524_093, int(rng.integers(4096, 1 << 20))]))
    if roll < 0.995:
        return int(rng.integers(1 << 20, 8 << 20))
    return int(rng.integers(8 << 20, 64 << 20))


def schedule(seed: int, count: int, size: int) -> list[tuple[int, int, int, int, int, int]]:
    """``(index, src, dst, tag, nbytes, payload seed)`` for every message, identical on every rank."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        src, dst = (int(r) for r in rng.integers(0, size, 2))
        out.append((i, src, dst, int(rng.integers(0, 64)), _nbytes(rng), int(rng.integers(0, 2**31))))
    return out


def payload(nbytes: int, seed: int) -> Any:
    """The payload of one message, rebuilt identically from its seed on sender and receiver."""
    import torch

    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 7)
    if kind == 0:
        return rng.bytes(nbytes)
    if kind == 1 or kind == 2:
        dtype = np.dtype(str(rng.choice(DTYPES)))
        n = nbytes // dtype.itemsize
        flat = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
        if dtype.kind == "b":
            flat = flat.view(np.uint8) % 2 == 1
        if kind == 2 and n >= 4:  # strided: every other element of a longer array
            return np.repeat(flat, 2)[::2]
        return flat.reshape(-1, 2) if n % 2 == 0 and n else flat
    if kind == 3:
        name = str(rng.choice(TORCH_DTYPES))
        dtype = getattr(torch, name)
        n = nbytes // torch.tensor([], dtype=dtype).element_size()
        raw = torch.from_numpy(rng.integers(0, 256, n * torch.tensor([], dtype=dtype).element_size(), dtype=np.uint8))
        if n == 0:
            return torch.empty(0, dtype=dtype)
        return (raw % 2 == 1) if dtype == torch.bool else raw.view(dtype)
    if kind == 4:
        return np.array(rng.normal())  # 0-d
    if kind == 5:  # a batch: a dict of arrays and tensors
        return {"obs": rng.integers(0, 256, nbytes // 2, dtype=np.uint8), "act": torch.arange(3) + seed % 7}
    return {"n": int(seed % 1000), "nested": {"x": [1.5, None, "héllo"], "s": "x" * min(nbytes, 4096)}}


def _bits(t: Any) -> bytes:
    import torch

    flat = t.contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def same(want: Any, got: Any) -> bool:
    import torch

    if isinstance(want, bytes):
        return type(got) is bytes and got == want
    if isinstance(want, np.ndarray):
        return (isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
                and np.ascontiguousarray(want).tobytes() == np.ascontiguousarray(got).tobytes())
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and _bits(got) == _bits(want))  # bit for bit: random bits hold NaNs, which equal nothing
    if isinstance(want, dict):
        return isinstance(got, dict) and list(got) == list(want) and all(same(want[k], got[k]) for k in want)
    return bool(want == got)


def worker(seed: int, count: int) -> None:
    import popmesh
    from popmesh.comm import messages as m
    from popmesh.observe.stats import gather_rows

    world = popmesh.init()
    rank, size = world.rank, world.size
    plan = schedule(seed, count, size)
    order_rng = np.random.default_rng(seed + 1000 + rank)
    checked = wrong = nbytes_checked = 0
    failures: list[str] = []
    start = time.perf_counter()
    pos = 0
    while pos < len(plan):
        batch, total = [], 0
        while pos < len(plan) and (not batch or total + plan[pos][4] <= ROUND_NBYTES):
            batch.append(plan[pos])
            total += plan[pos][4]
            pos += 1
        handles: list[tuple[str, Any, tuple]] = []
        for msg in batch:
            i, src, dst, tag, nbytes, pseed = msg
            if src == rank:
                handles.append(("send", m.isend(payload(nbytes, pseed), dst, tag=tag, timeout=120), msg))
            if dst == rank:
                handles.append(("recv", m.irecv(src, tag=tag, timeout=120), msg))
        for k in order_rng.permutation(len(handles)):
            what, handle, msg = handles[int(k)]
            result = handle.wait()
            if what == "recv":
                i, src, _, tag, nbytes, pseed = msg
                got_src, got = result
                checked += 1
                nbytes_checked += nbytes
                if got_src != src or not same(payload(nbytes, pseed), got):
                    wrong += 1
                    failures.append(f"message {i} from {src} on tag {tag} ({nbytes} B)")
        popmesh.barrier(timeout=300)
    elapsed = time.perf_counter() - start
    rows = gather_rows(np.array([[checked, wrong, nbytes_checked]], dtype=np.int64))
    if rank == 0:
        write_result({"rows": np.asarray(rows).tolist(), "expected": len(plan), "seconds": elapsed})
    if failures:
        print(f"rank {rank}: {wrong} wrong: {failures[:5]}", file=sys.stderr)
    world.finalize()


def _burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--engines", default="torch,mpi")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--burners", type=int, default=0, help="CPU-bound processes to run beside the world")
    args = parser.parse_args()
    burners = _burners(args.burners)
    failed = False
    try:
        for engine in args.engines.split(","):
            result = launch_json(os.path.abspath(__file__), args.ranks, engine, "--worker", str(args.seed),
                                 str(args.messages), timeout=3600)
            rows = np.asarray(result["rows"], dtype=np.int64).reshape(args.ranks, -1)
            checked, wrong, nbytes = (int(v) for v in rows.sum(axis=0)[:3])
            lost = result["expected"] - checked
            failed |= bool(wrong or lost)
            print(f"{engine:6} {args.ranks} ranks, {args.burners} burners: {checked:,} messages checked "
                  f"({nbytes / 1e9:.2f} GB), wrong {wrong}, lost {lost}, {result['seconds']:.1f} s")
    finally:
        for b in burners:
            b.kill()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        worker(int(sys.argv[at + 1]), int(sys.argv[at + 2]))
    else:
        main()
