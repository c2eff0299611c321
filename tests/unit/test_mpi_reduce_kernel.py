"""The in-window all-reduce's one-pass C arithmetic (``_reduce.combine``) gives numpy's bits: the sum
in rank order, then the division by the member count, every copy overwritten with the result."""

import numpy as np
import pytest

from popmesh.engines.mpi.native import load_reduce
from popmesh.engines.mpi.shared_reduce import _KINDS


@pytest.fixture(scope="module")
def kernel():
    module = load_reduce()
    assert module is not None, "run `python -m popmesh.engines.mpi.build_native` (make does)"
    return module


def numpy_reduce(copies: list[np.ndarray], average: bool) -> np.ndarray:
    """shared_reduce's numpy path, on copies of the chunks."""
    acc = copies[0].copy()
    with np.errstate(all="ignore"):  # the edges overflow and make NaN, as they may in training
        for other in copies[1:]:
            np.add(acc, other, out=acc)
        if average:
            np.divide(acc, len(copies), out=acc)
    return acc


def chunks(dtype: np.dtype, members: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        scale = 10.0 ** rng.integers(-30, 30, (members, count))
        out = [(rng.standard_normal(count) * scale[k]).astype(dtype) for k in range(members)]
        if count > 8:  # the edges: NaN, infinities of both signs, signed zeros, the largest finite values
            info = np.finfo(dtype)
            out[0][:8] = [np.nan, np.inf, -np.inf, -0.0, 0.0, info.max, -info.max, info.tiny]
            out[-1][:8] = [1.0, -np.inf, -np.inf, -0.0, -0.0, info.max, 1.0, info.tiny]
        return out
    info = np.iinfo(dtype)  # the whole range: sums that wrap around, as numpy's do
    return [rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True) for _ in range(members)]


@pytest.mark.parametrize("dtype", list(_KINDS), ids=str)
@pytest.mark.parametrize("members", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 7, 4095, 4096, 4097, 100_003])
def test_the_same_bits_as_numpy_in_every_copy(kernel, dtype, members, count):
    for average in (False, True) if dtype.kind == "f" else (False,):
        copies = chunks(dtype, members, count, seed=count * 10 + members)
        want = numpy_reduce(copies, average)
        kernel.combine(copies, _KINDS[dtype], average)
        for copy in copies:
            assert copy.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), (dtype, members, count, average)


def test_views_into_larger_arrays_are_reduced_in_place(kernel):
    a, b = np.arange(20, dtype=np.float32), np.arange(20, dtype=np.float32) * 3
    kernel.combine([a[4:12], b[4:12]], _KINDS[np.dtype(np.float32)], True)
    assert a[4:12].tolist() == b[4:12].tolist() == [2.0 * i for i in range(4, 12)]
    assert a[:4].tolist() == [0, 1, 2, 3] and b[12:].tolist() == [3.0 * i for i in range(12, 20)]


@pytest.mark.parametrize("copies, kind, average, message", [
    ([np.ones(4, np.float32), np.ones(3, np.float32)], 0, False, "differ in length"),
    ([np.ones(4, np.int32)], 2, True, "not one this kernel reduces"),
    ([np.ones(4, np.float32)], 9, False, "not one this kernel reduces"),
    ([], 0, False, "copies"),
])
def test_bad_input_is_refused_with_a_reason(kernel, copies, kind, average, message):
    with pytest.raises(ValueError, match=message):
        kernel.combine(copies, kind, average)


def test_read_only_memory_is_refused(kernel):
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        kernel.combine([frozen, np.ones(4, np.float32)], 0, False)
