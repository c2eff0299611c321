"""Chunk and transfer plans of the streamed hand-over (pure: popmesh.torch.chunking, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popmesh.core.errors import ConfigError
from popmesh.torch.chunking import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    Piece,
    TensorSpec,
    compare_specs,
    fewest_applied,
    hand_over_roles,
    plan_chunks,
    plan_stream,
    plan_transfers,
)

DTYPES = ("float32", "bfloat16", "int64", "bool", "complex128", "float16", "uint8")


def covered(specs, chunks):
    """Every (tensor, element) the chunks carry, checking pieces never overlap inside a chunk."""
    seen = []
    for chunk in chunks:
        end = 0
        for piece in chunk.pieces:
            size = specs[piece.tensor].itemsize
            assert piece.offset % size == 0, piece
            assert piece.offset >= end, (chunk, piece)
            end = piece.offset + (piece.stop - piece.start) * size
            seen += [(piece.tensor, e) for e in range(piece.start, piece.stop)]
        assert end == chunk.nbytes
    return seen


def test_small_tensors_share_a_chunk_and_a_large_one_spans_chunks_of_its_own():
    specs = [TensorSpec("a", "float32", (3,)), TensorSpec("big", "float32", (40,)), TensorSpec("c", "int64", ()),
             TensorSpec("d", "bool", (3,))]
    assert plan_chunks(specs, 64) == (
        Chunk(0, (Piece(0, 0, 3, 0),), 12),
        Chunk(1, (Piece(1, 0, 16, 0),), 64),
        Chunk(2, (Piece(1, 16, 32, 0),), 64),
        Chunk(3, (Piece(1, 32, 40, 0),), 32),
        Chunk(4, (Piece(2, 0, 1, 0), Piece(3, 0, 3, 8)), 11),
    )


def test_a_quarter_chunk_travels_alone_and_a_small_tensor_is_never_split():
    specs = [TensorSpec("x", "uint8", (10,)), TensorSpec("y", "uint8", (16,)), TensorSpec("z", "uint8", (15,)),
             TensorSpec("w", "uint8", (15,))]
    assert [[(p.tensor, p.start, p.stop) for p in c.pieces] for c in plan_chunks(specs, 64)] == [
        [(0, 0, 10)], [(1, 0, 16)], [(2, 0, 15), (3, 0, 15)]]
    specs = [TensorSpec(f"t{i}", "float32", (3,)) for i in range(6)]  # 12 bytes each, five fit in 64
    assert [len(c.pieces) for c in plan_chunks(specs, 64)] == [5, 1]


def test_pieces_start_at_a_multiple_of_their_element_size():
    specs = [TensorSpec("flag", "bool", (1,)), TensorSpec("x", "float64", (2,)), TensorSpec("h", "bfloat16", (3,))]
    (chunk,) = plan_chunks(specs, 128)
    assert [p.offset for p in chunk.pieces] == [0, 8, 24]
    assert chunk.nbytes == 30


def test_empty_tensors_take_no_piece_and_an_empty_state_no_chunk():
    specs = [TensorSpec("e", "float32", (0, 5)), TensorSpec("x", "int64", (2,)), TensorSpec("f", "bfloat16", (0,))]
    (chunk,) = plan_chunks(specs, DEFAULT_CHUNK_BYTES)
    assert chunk.pieces == (Piece(1, 0, 2, 0),)
    assert plan_chunks([TensorSpec("e", "float32", (0,))]) == ()
    assert plan_chunks([]) == ()


def test_a_bad_chunk_size_is_a_config_error():
    for bad in (0, 15, 1.5, "64", True):
        with pytest.raises(ConfigError, match="chunk_bytes"):
            plan_chunks([], bad)


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 7), max_size=3)), max_size=8),
       chunk_bytes=st.integers(16, 300))
def test_every_element_travels_exactly_once_in_order(shapes, chunk_bytes):
    specs = [TensorSpec(f"t{i}", d, tuple(s)) for i, (d, s) in enumerate(shapes)]
    chunks = plan_chunks(specs, chunk_bytes)
    assert covered(specs, chunks) == [(i, e) for i, s in enumerate(specs) for e in range(s.numel)]
    assert all(0 < c.nbytes <= chunk_bytes for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for chunk in chunks:  # a large tensor's pieces travel alone; a small tensor is one piece
        big = [p for p in chunk.pieces if specs[p.tensor].nbytes >= chunk_bytes // 4]
        assert not big or len(chunk.pieces) == 1
        assert all(p.stop - p.start == specs[p.tensor].numel for p in chunk.pieces if not big)


def test_transfers_go_round_the_donors():
    chunks = plan_chunks([TensorSpec("w", "float32", (40,))], 16)  # ten chunks of 16 bytes
    transfers = plan_transfers(chunks, donors=[0, 1], receivers=[2, 3])
    assert [(t.chunk, t.donor, t.receiver) for t in transfers[:4]] == [(0, 0, 2), (0, 1, 3), (1, 1, 2), (1, 0, 3)]


@settings(max_examples=100, deadline=None)
@given(n_chunks=st.integers(0, 30), n_donors=st.integers(1, 4), n_receivers=st.integers(0, 4),
       last=st.integers(16, 64))
def test_each_receiver_takes_each_chunk_once_and_donors_share_evenly(n_chunks, n_donors, n_receivers, last):
    specs = [TensorSpec("w", "uint8", (64 * max(n_chunks - 1, 0) + (last if n_chunks else 0),))]
    donors, receivers = list(range(n_donors)), list(range(10, 10 + n_receivers))
    plan = plan_stream(specs, donors, receivers, 64)
    assert len(plan.chunks) == n_chunks
    for r in receivers:
        assert [c for c, _ in plan.receives_of(r)] == list(range(n_chunks))
        if n_chunks >= n_donors:
            assert {d for _, d in plan.receives_of(r)} == set(donors)  # every donor's link is used
    shares = [plan.bytes_sent(d) for d in donors]
    assert sum(shares) == plan.nbytes * n_receivers
    assert max(shares) - min(shares) <= 64 * n_receivers  # at most one chunk per receiver apart
    for d in donors:
        assert all(set(rs) <= set(receivers) for _, rs in plan.sends_of(d))


def test_bad_roles_are_config_errors():
    chunks = plan_chunks([TensorSpec("w", "float32", (4,))])
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] are both"):
        plan_transfers(chunks, [0, 1], [1, 2])
    with pytest.raises(ConfigError, match="names a rank twice"):
        plan_transfers(chunks, [0, 0], [1])
    with pytest.raises(ConfigError, match="no donor"):
        plan_transfers(chunks, [], [1])
    assert plan_transfers(chunks, [0], []) == ()


def test_hand_over_roles():
    assert hand_over_roles([0, 1, 2, 3], src=0) == ((0,), (1, 2, 3))  # one donor: every other rank takes
    assert hand_over_roles([0, 1, 2, 3], src=1, newcomers=[2]) == ((1,), (0, 2, 3))
    assert hand_over_roles([0, 1, 2, 3], src=0, newcomers=[1, 3], donors=2) == ((0, 2), (1, 3))
    assert hand_over_roles([0, 1, 2, 3], src=2, newcomers=[3], donors=5) == ((2, 0, 1), (3,))
    with pytest.raises(ConfigError, match="holds no state"):
        hand_over_roles([0, 1], src=1, newcomers=[1], donors=2)
    with pytest.raises(ConfigError, match="not one of the ranks"):
        hand_over_roles([0, 1], src=4)
    with pytest.raises(ConfigError, match="at least 1"):
        hand_over_roles([0, 1], src=0, donors=0)


def test_the_survivors_that_applied_the_fewest_steps_hold_the_state_to_give():
    assert fewest_applied([0, 1, 2], [7, 7, 7]) == (0, 1, 2)
    assert fewest_applied([0, 1, 2, 3], [8, 7, None, 7], newcomers=[2]) == (1, 3)  # rank 0 applied a failed step
    assert fewest_applied([4, 6], [3, 0], newcomers=[6]) == (4,)  # a newcomer's count is ignored
    with pytest.raises(ConfigError, match="rank 1 passed applied=None"):
        fewest_applied([0, 1], [3, None])
    with pytest.raises(ConfigError, match="rank 0 passed applied=-1"):
        fewest_applied([0, 1], [-1, 2])
    with pytest.raises(ConfigError, match="rank 0 passed applied=True"):
        fewest_applied([0, 1], [True, 2])
    with pytest.raises(ConfigError, match="no survivor"):
        fewest_applied([0, 1], [None, None], newcomers=[0, 1])
    with pytest.raises(ConfigError, match="one per rank"):
        fewest_applied([0, 1], [1])


def test_a_survivor_ahead_of_the_holders_takes_the_state_too():
    # rank 0 applied the step that failed: rank 1 gives, ranks 0 and 2 (the newcomer) take
    assert hand_over_roles([0, 1, 2], src=1, newcomers=[2], donors=2, holders=[1]) == ((1,), (0, 2))
    assert hand_over_roles([0, 1, 2, 3], src=1, newcomers=[3], donors=2, holders=[1, 2]) == ((1, 2), (0, 3))
    with pytest.raises(ConfigError, match="not among the ranks that hold"):
        hand_over_roles([0, 1, 2], src=0, newcomers=[2], donors=2, holders=[1])


def test_compare_specs_names_the_tensor():
    donor = [TensorSpec("fc.weight", "float32", (4, 3)), TensorSpec("fc.bias", "float32", (4,))]
    assert compare_specs(donor, list(reversed(donor))) is None  # order aside
    shape = [TensorSpec("fc.weight", "float32", (3, 4)), TensorSpec("fc.bias", "float32", (4,))]
    assert compare_specs(donor, shape) == "tensor 'fc.weight' is float32 (3, 4) here and float32 (4, 3) on the donor"
    dtype = [TensorSpec("fc.weight", "float32", (4, 3)), TensorSpec("fc.bias", "bfloat16", (4,))]
    assert "tensor 'fc.bias' is bfloat16 (4,) here" in compare_specs(donor, dtype)
    assert compare_specs(donor, donor[:1]) == "tensor 'fc.bias' (float32 (4,) on the donor) is missing here"
    extra = donor + [TensorSpec("head.weight", "float32", (2,))]
    assert compare_specs(donor, extra) == "tensor 'head.weight' is here but not on the donor"
    with pytest.raises(ConfigError, match="shape"):
        TensorSpec("x", "float32", (-1,))
