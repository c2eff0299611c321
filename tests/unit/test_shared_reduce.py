"""The shared-window all-reduce's pure parts: how an array is split into the ranks' chunks."""

import itertools

import pytest

from popmesh.engines.mpi.shared_reduce import aligned, chunk_bounds


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 1000, 1_000_003])
@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_chunks_tile_the_array_on_cache_lines(numel, itemsize, parts):
    bounds = [chunk_bounds(numel, itemsize, parts, k) for k in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (lo, hi), (next_lo, _) in itertools.pairwise(bounds):
        assert lo <= hi == next_lo
        assert (hi * itemsize) % 64 == 0 or hi == numel  # no cache line is written by two ranks
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 64 // itemsize or numel < parts * 64 // itemsize


def test_aligned_rounds_up_to_a_cache_line():
    assert [aligned(n) for n in (0, 1, 64, 65, 128)] == [0, 64, 64, 128, 128]
