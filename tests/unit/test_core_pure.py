"""Pure building blocks of the collectives: ops, trees, fusion plans, the object codec."""

from collections import namedtuple

import numpy as np
import pytest

import popmesh
from popmesh.comm.fusion import apply_fused, fuse_groups
from popmesh.core.arrays import dtype_name, flatten, restore_scalar, unflatten
from popmesh.core.errors import ConfigError, MessageError, PeerFailure
from popmesh.core.ops import Lowering, ReduceOp, lower
from popmesh.wire.objects import decode_object, encode_object

Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize("name, op", [("sum", ReduceOp.SUM), ("MEAN", ReduceOp.AVG), ("avg", ReduceOp.AVG),
                                      ("Max", ReduceOp.MAX), ("product", ReduceOp.PROD)])
def test_reduce_op_parse(name, op):
    assert ReduceOp.parse(name) is op


def test_reduce_op_foreign_enum_and_error():
    class Foreign:
        name = "MIN"

    assert ReduceOp.parse(Foreign()) is ReduceOp.MIN
    with pytest.raises(ConfigError, match="use one of"):
        ReduceOp.parse("median")


def test_flatten_round_trip_keeps_containers():
    tree = {"b": [np.ones(2), (3, Pair(np.zeros(1), 2.5))], "a": np.int64(4)}
    leaves, treedef = flatten(tree)
    assert len(leaves) == 5
    rebuilt = unflatten(treedef, leaves)
    assert list(rebuilt) == ["b", "a"] and isinstance(rebuilt["b"][1][1], Pair)
    assert treedef.describe() == flatten(rebuilt)[1].describe()


def test_flatten_rejects_unknown_leaf():
    with pytest.raises(TypeError, match="_object variants"):
        flatten({"x": object()})


def test_restore_scalar_types():
    assert type(restore_scalar(1, np.asarray(3))) is int
    assert type(restore_scalar(1.0, np.asarray(3))) is float
    assert type(restore_scalar(True, np.asarray(1))) is bool
    assert restore_scalar(np.float32(1), np.asarray(2.0)).dtype == np.float32


def test_fuse_groups_by_dtype():
    leaves = [np.zeros(2, np.float32), np.zeros(3, np.float64), np.zeros(1, np.float32)]
    assert sorted(fuse_groups(leaves)) == [[0, 2], [1]]
    assert dtype_name(leaves[1]) == "float64"


def test_apply_fused_in_place_and_returning():
    leaves = [np.ones(2), np.full((2, 2), 2.0), np.ones(3, np.int32)]
    calls = []

    def double(buf):
        calls.append(buf.shape)
        buf *= 2

    out = apply_fused(leaves, double, in_place=False)
    assert calls == [(6,), (3,)], "same-dtype leaves fuse into one buffer"
    assert out[1].tolist() == [[4.0, 4.0], [4.0, 4.0]] and leaves[1][0, 0] == 2.0
    apply_fused(leaves, double, in_place=True)
    assert leaves[0].tolist() == [2.0, 2.0] and leaves[2].tolist() == [2, 2, 2]


def test_object_codec():
    assert decode_object(encode_object({"a": [1, 2.5, None]})) == {"a": [1, 2.5, None]}
    with pytest.raises(MessageError, match="allow_pickle"):
        encode_object({1, 2})
    frame = encode_object({1, 2}, allow_pickle=True)
    with pytest.raises(MessageError, match="allow_pickle"):
        decode_object(frame)
    assert decode_object(frame, allow_pickle=True) == {1, 2}
    with pytest.raises(MessageError):
        decode_object(np.frombuffer(b"Zjunk", np.uint8))
    batch = decode_object(encode_object({"obs": np.arange(6).reshape(2, 3)}))
    assert batch["obs"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_world_of_one_is_identity():
    x = {"a": np.arange(3.0), "b": 2}
    assert popmesh.all_reduce(x, "avg") is x
    assert popmesh.all_gather(np.arange(3)).shape == (1, 3)
    assert popmesh.all_gather(np.arange(3), concat=True).shape == (3,)
    assert [p.tolist() for p in popmesh.all_gather_ragged(np.arange(2))] == [[0, 1]]
    assert popmesh.broadcast(5) == 5 and popmesh.reduce_scatter(np.ones(4)).shape == (4,)
    assert popmesh.gather(np.ones(2)).shape == (1, 2)
    popmesh.barrier()


def test_import_starts_no_engine():
    import subprocess
    import sys

    code = "import sys, popmesh; print(sorted(m for m in ('torch', 'mpi4py', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_world_finalize_is_idempotent_and_a_context_manager():
    import subprocess
    import sys

    code = (
        "import popmesh\n"
        "with popmesh.init(engine='local') as w:\n"
        "    assert w.rank == 0 and w.size == 1 and w.is_main and w.local_size == 1\n"
        "w.finalize(); w.finalize(); popmesh.finalize()\n"
        "assert w.finalized\n"
        "w2 = popmesh.init(engine='local'); assert w2 is not w and popmesh.init() is w2\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "POPMESH_ENGINE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "ok"


def test_peer_failure_always_names_ranks():
    with pytest.raises(ValueError, match="ranks at fault"):
        PeerFailure("a peer died", ())
    exact = PeerFailure("rank 2 died", (2,))
    assert exact.ranks == (2,) and exact.exact
    suspects = PeerFailure("a peer of the all_reduce died", [1, 3], exact=False)
    assert suspects.ranks == (1, 3) and not suspects.exact


def test_peer_failure_survives_pickling():
    import pickle

    back = pickle.loads(pickle.dumps(PeerFailure("rank 1 died", (1,), exact=False)))
    assert isinstance(back, PeerFailure) and back.ranks == (1,) and not back.exact and str(back) == "rank 1 died"


@pytest.mark.parametrize("op, dtype, expected", [
    (ReduceOp.AVG, "float32", Lowering(ReduceOp.SUM, False, True)),
    (ReduceOp.SUM, "int64", Lowering(ReduceOp.SUM, False, False)),
    (ReduceOp.PROD, "float64", Lowering(ReduceOp.PROD, False, False)),
    (ReduceOp.SUM, "bool", Lowering(ReduceOp.MAX, True, False)),
    (ReduceOp.MAX, "bool", Lowering(ReduceOp.MAX, True, False)),
    (ReduceOp.MIN, "bool", Lowering(ReduceOp.MIN, True, False)),
    (ReduceOp.PROD, "bool", Lowering(ReduceOp.MIN, True, False)),
    (ReduceOp.SUM, "complex64", Lowering(ReduceOp.SUM, False, False)),
])
def test_one_lowering_of_avg_and_booleans(op, dtype, expected):
    assert lower(op, dtype) == expected
    assert lower(op, dtype) is lower(op, dtype)  # built once, then looked up (the 4 B call's latency)


@pytest.mark.parametrize("op, dtype", [(ReduceOp.AVG, "bool"), (ReduceOp.MAX, "complex64"),
                                       (ReduceOp.MIN, "complex128")])
def test_undefined_reductions_are_refused(op, dtype):
    for _ in range(2):  # a refusal is never cached as an answer
        with pytest.raises(ConfigError, match="undefined"):
            lower(op, dtype)


def test_one_dtype_table_agrees_with_numpy_and_torch():
    import torch

    from popmesh.core.dtypes import DTYPES, canonical_dtype, itemsize

    assert len({d.wire_code for d in DTYPES}) == len(DTYPES)  # codes are unique
    for d in DTYPES:
        assert itemsize(d.name) == getattr(torch, d.name).itemsize
        if d.name != "bfloat16":
            assert itemsize(d.name) == np.dtype(d.name).itemsize
        assert canonical_dtype(f"torch.{d.name}") == d.name
    with pytest.raises(ConfigError, match="unknown dtype"):
        itemsize("float12")


class _Later:
    """A Pending that finishes on the second poll and times out once before that."""

    def __init__(self) -> None:
        self.polls = 0

    def done(self) -> bool:
        self.polls += 1
        return self.polls > 1

    def wait(self, timeout: float) -> str:
        if self.polls < 1:
            self.polls += 1
            raise popmesh.CommTimeout(f"not yet ({timeout} s)")
        return "raw"


def test_handle_finishes_once_and_survives_a_timed_out_wait():
    from popmesh.core.handles import Handle

    calls = []
    handle = Handle(_Later(), 7.0, lambda raw: calls.append(raw) or f"done:{raw}")
    with pytest.raises(popmesh.CommTimeout, match=r"7\.0 s"):
        handle.wait()  # the default timeout is the call's
    assert handle.wait(1) == "done:raw" and handle.wait() == "done:raw" and handle.done()
    assert calls == ["raw"]


def test_flat_buffers_pack_view_and_copy_back_for_numpy_and_torch():
    import torch

    from popmesh.core.flat import copy_back, flatten_into, group_indices, packed_offsets, views_of

    assert group_indices(["f", "i", "f", "b", "i"]) == [[0, 2], [1, 4], [3]]
    assert packed_offsets([3, 2, 4]) == ([0, 3, 5], 9)
    for kind in (np, torch):
        dtype = kind.float64
        parts = [kind.arange(6, dtype=dtype).reshape(2, 3), kind.full((), 7.0, dtype=dtype),
                 kind.arange(10, 14, dtype=dtype)]
        flat = flatten_into(parts)
        assert [float(v) for v in flat] == [0, 1, 2, 3, 4, 5, 7, 10, 11, 12, 13]
        views = views_of(flat, [p.shape for p in parts])
        assert all((v == p).all() for v, p in zip(views, parts))
        views[0][0, 0] = -1.0  # a view, not a copy
        assert float(flat[0]) == -1.0
        targets = [p.clone() if torch.is_tensor(p) else p.copy() for p in parts]
        for target in targets:
            target *= 0
        copy_back(flat, targets)
        assert float(targets[0][0, 0]) == -1.0 and float(targets[2][3]) == 13.0
        out = flat * 0
        assert flatten_into(parts, out=out) is out and float(out[6]) == 7.0


def test_peer_failures_name_the_hosts_of_the_ranks_at_fault():
    import pickle

    from popmesh.core.errors import PeerFailure, know_hosts

    know_hosts([])
    assert PeerFailure("gone", [1]).hosts == ("",), "no world yet: hosts unknown"
    know_hosts(["a", "a"])
    one_host = PeerFailure("rank 1 died", [1])
    assert one_host.hosts == ("a",) and str(one_host) == "rank 1 died", "one host: the message stays short"
    know_hosts(["a", "a", "b"])
    try:
        error = PeerFailure("rank 2 died", [2])
        assert error.hosts == ("b",) and str(error) == "rank 2 died (rank 2 on host b)"
        again = pickle.loads(pickle.dumps(error))
        assert str(again) == str(error) and again.hosts == ("b",)
    finally:
        know_hosts([])
