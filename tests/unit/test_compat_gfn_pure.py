"""torchgfn facade details its users' code and tests depend on, without a world."""

import pytest

pytest.importorskip("torch")

import popmesh.compat.gfn as gfn


@pytest.mark.parametrize("call", [
    lambda: gfn.barrier(backend="nccl-ish"), lambda: gfn.get_rank(backend="bogus"),
    lambda: gfn.get_world_size(backend="bogus"),
])
def test_an_unknown_backend_is_the_value_error_upstream_tests_match(call):
    with pytest.raises(ValueError, match="Unknown backend"):
        call()


def test_upstream_private_helpers_exist(monkeypatch):
    monkeypatch.setenv("POPMESH_TEST_B", "b")
    monkeypatch.delenv("POPMESH_TEST_A", raising=False)
    assert gfn._first_env("POPMESH_TEST_A", "POPMESH_TEST_B") == "b"
    assert gfn._first_env("POPMESH_TEST_A", default="d") == "d"
    pytest.importorskip("mpi4py")
    assert gfn._get_MPI().__name__ == "mpi4py.MPI"
