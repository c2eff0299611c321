"""The pure parts behind torchgfn's MPI arms and its failing ranks: the heartbeat's failing note, the
text a failing rank sends, which environments an MPI launcher made, and the context's ``dc_mpi4py``
field, which says how to launch where the job has no MPI."""

from __future__ import annotations

import numpy as np
import pytest

from popmesh.core.errors import ConfigError, PeerFailure
from popmesh.engines import failing
from popmesh.engines.liveness import BEAT, FAILING, decode_note, encode_note, failing_note, note_text
from popmesh.engines.mpi.beside import launched_by_mpi


def test_a_failing_note_carries_its_sender_and_error():
    note = failing_note(3, "ValueError: trainer 3 gives up ✗")
    assert decode_note(note) == (FAILING, 3, 3, 0.0)
    assert note_text(note) == "ValueError: trainer 3 gives up ✗"
    assert note_text(failing_note(1, "x" * 5000)) == "x" * 512  # a note stays small
    assert note_text(encode_note(BEAT, 1).view(np.uint8)) == ""


def test_only_a_failing_note_may_carry_text():
    beat_with_text = np.concatenate([encode_note(BEAT, 1).view(np.uint8), np.frombuffer(b"hello", np.uint8)])
    with pytest.raises(ConfigError):
        decode_note(beat_with_text)
    with pytest.raises(ConfigError):
        decode_note(failing_note(2, "boom")[:39])


def test_describe_keeps_the_type_and_the_first_line():
    assert failing.describe(ValueError("trainer 0 gives up\nmore detail")) == "ValueError: trainer 0 gives up"
    assert failing.describe(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert len(failing.describe(RuntimeError("y" * 1000))) == 400
    assert failing._lost_a_peer(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4711"))
    assert failing._lost_a_peer(PeerFailure("rank 1 closed its connection", (1,)))
    assert not failing._lost_a_peer(ValueError("trainer 0 gives up"))


@pytest.mark.parametrize(("environ", "mpi"), [
    ({}, False),
    ({"RANK": "0", "WORLD_SIZE": "2"}, False),  # torchrun, popmesh launch
    ({"PMI_RANK": "1", "PMI_SIZE": "3"}, True),  # MPICH's Hydra
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, True),  # Open MPI
    ({"PMIX_RANK": "0"}, True),  # srun --mpi=pmix
    ({"PMI_RANK": ""}, False),
])
def test_which_launch_is_an_mpi_launch(environ, mpi):
    assert launched_by_mpi(environ) is mpi


def test_dc_mpi4py_says_how_to_launch_where_there_is_no_mpi():
    pytest.importorskip("torch")
    import popmesh.compat.gfn as gfn
    from popmesh.compat._mpi_side import Unavailable

    ctx = gfn.DistributedContext(world=None, layout=None, my_rank=0, world_size=1, num_training_ranks=1,
                                 agent_group_size=1, agent_groups=[], agent_group_id=0, train_global_group=None)
    assert ctx.dc_mpi4py is None  # torchgfn's default
    ctx.dc_mpi4py = Unavailable("launch it with `mpiexec -n 3 python script.py`")
    with pytest.raises(ConfigError, match="mpiexec -n 3"):
        _ = ctx.dc_mpi4py
    assert "dc_mpi4py" not in repr(ctx)  # a context prints without asking for it
    view = gfn.DistributedContextMPI4Py(world=None, layout=None, my_rank=0, world_size=1, num_training_ranks=1,
                                        agent_group_size=1, agent_groups=[], agent_group_id=0,
                                        train_global_group=None)
    ctx.dc_mpi4py = view
    assert ctx.dc_mpi4py is view and "dc_mpi4py" in gfn.DistributedContext.__dataclass_fields__
