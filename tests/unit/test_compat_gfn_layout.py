"""torchgfn's ``RankLayout`` in popmesh.compat.gfn, without a world: the assignments of torchgfn's master
(``gfn/utils/distributed.py`` at f39bfc96) for a table of worlds, written out below, and what popmesh does
differently (ConfigError for bad input, LayoutWarning); the rank and size an MPI launcher announced."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("torch")

from popmesh import ConfigError
from popmesh.compat import gfn
from popmesh.compat._gfn_ranks import announced_by_mpi, check_announced, native_layout
from popmesh.topology import LayoutWarning
from popmesh.topology import RankLayout as NativeLayout


def block(*sizes: int) -> list[str]:
    """Block placement: consecutive ranks fill each node in turn."""
    return [f"node{i}" for i, n in enumerate(sizes) for _ in range(n)]


def cyclic(nodes: int, world_size: int) -> list[str]:
    """Cyclic placement: rank r on node r % nodes."""
    return [f"node{r % nodes}" for r in range(world_size)]


# (how it is built, torchgfn master's training_ranks, buffer_ranks, agent_ranks_per_group, agent_group_rank_list)
TABLE = [
    (("build", 8, 2, 2, 2, 0), [0, 1, 2, 4, 5, 6], [3, 7], [[0, 1, 2], [4, 5, 6]], [[0, 1, 2], [4, 5, 6]]),
    (("build", 9, 2, 2, 2, 1), [0, 1, 2, 4, 5, 6], [3, 7], [[0, 1, 2], [4, 5, 6]], [[0, 1, 2], [4, 5, 6]]),
    (("build", 8, 0, 2, 2, 0), list(range(8)), [], [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (("build", 7, 0, 3, 1, 1), list(range(6)), [], [[0, 1], [2, 3], [4, 5]], [list(range(6))]),
    (("build", 10, 3, 1, 1, 0), [0, 1, 2, 4, 5, 7, 8], [3, 6, 9], [[0, 1, 2], [4, 5], [7, 8]],
     [[0, 1, 2, 4, 5, 7, 8]]),
    (("build", 5, 2, 1, 1, 1), [0, 2], [1, 3], [[0], [2]], [[0, 2]]),
    (("hosts", 8, 2, 2, 0, block(4, 4)), [0, 1, 2, 4, 5, 6], [3, 7], [[0, 1, 2], [4, 5, 6]], [[0, 1, 2], [4, 5, 6]]),
    (("hosts", 8, 2, 2, 0, cyclic(2, 8)), [0, 2, 4, 1, 3, 5], [6, 7], [[0, 2, 4], [1, 3, 5]], [[0, 2, 4], [1, 3, 5]]),
    (("hosts", 9, 2, 2, 1, cyclic(2, 9)), [0, 2, 4, 1, 3, 5], [6, 7], [[0, 2, 4], [1, 3, 5]], [[0, 2, 4], [1, 3, 5]]),
    (("hosts", 12, 4, 2, 0, block(6, 6)), [0, 1, 3, 4, 6, 7, 9, 10], [2, 5, 8, 11], [[0, 1], [3, 4], [6, 7], [9, 10]],
     [[0, 1, 3, 4], [6, 7, 9, 10]]),
    (("hosts", 8, 2, 2, 0, block(5, 3)), [0, 1, 2, 3, 5, 6], [4, 7], [[0, 1, 2, 3], [5, 6]], [[0, 1, 2], [3, 5, 6]]),
    (("hosts", 5, 2, 1, 1, cyclic(2, 5)), [0, 1], [2, 3], [[0], [1]], [[0, 1]]),
    (("hosts", 5, 2, 1, 1, block(5)), [0, 2], [1, 3], [[0], [2]], [[0, 2]]),
    (("hosts", 9, 3, 3, 0, cyclic(3, 9)), [0, 3, 1, 4, 2, 5], [6, 7, 8], [[0, 3], [1, 4], [2, 5]],
     [[0, 3], [1, 4], [2, 5]]),
    (("hosts", 8, 2, 3, 0, cyclic(2, 8)), [0, 2, 4, 1, 3, 5], [6, 7], [[0, 2, 4], [1, 3, 5]],
     [[0, 2], [4, 1], [3, 5]]),
]


def made(how: tuple) -> gfn.RankLayout:
    kind, *args = how
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayoutWarning)  # the uneven cases warn; test_warnings says which
        return gfn.RankLayout.build(*args) if kind == "build" else gfn.RankLayout.from_hostnames(*args)


def ids(how: tuple) -> str:
    kind, world_size, buffers, *rest = how
    return f"{kind}-w{world_size}-b{buffers}-{'-'.join(str(x)[:12] for x in rest)}"


@pytest.mark.parametrize(("how", "training", "buffers", "per_group", "groups"), TABLE, ids=[ids(t[0]) for t in TABLE])
def test_the_facade_assigns_ranks_as_torchgfn_master(how, training, buffers, per_group, groups):
    layout = made(how)
    world_size, coordinators = how[1], how[-2] if how[0] == "hosts" else how[-1]
    assert layout.training_ranks == training and layout.buffer_ranks == buffers  # lists, in torchgfn's order
    assert layout.agent_ranks_per_group == per_group and layout.agent_group_rank_list == groups
    assert layout.num_training_ranks == len(training) and layout.agent_group_size == len(groups[0])
    assert layout.buffer_rank_set == set(buffers)
    native = layout.native
    assert native.world_size == world_size and native.coordinator_rank == (world_size - 1 if coordinators else None)
    for rank in range(world_size + 1):  # one past the world: torchgfn answers None, None, 0
        manager = next((m for m, served in zip(buffers, per_group) if rank in served), None)
        assert layout.assigned_buffer(rank) == manager
        assert layout.assigned_training_ranks(rank) == (per_group[buffers.index(rank)] if rank in buffers else None)
        first = per_group[buffers.index(rank)][0] if rank in buffers else rank
        want = next((g for g, members in enumerate(groups) if first in members), 0)
        assert layout.agent_group_id(rank) == want, rank


def test_managers_from_host_names_serve_their_own_node():
    for hostnames, buffers, coordinators in ((block(4, 4), 2, 0), (cyclic(2, 8), 2, 0), (cyclic(2, 9), 2, 1),
                                             (block(6, 6), 4, 0), (cyclic(3, 9), 3, 0), (cyclic(2, 5), 2, 1)):
        layout = made(("hosts", len(hostnames), buffers, 1, coordinators, hostnames))
        for manager, served in zip(layout.buffer_ranks, layout.agent_ranks_per_group):
            assert {hostnames[a] for a in served} == {hostnames[manager]}, (hostnames, manager, served)


def test_warnings():
    """A number of managers that the nodes do not divide falls back to arithmetic placement, saying so;
    torchgfn logged it. popmesh does not warn that one agent group spans nodes."""
    with pytest.warns(LayoutWarning, match=r"num_buffers=3 is not a multiple of the 2 nodes"):
        layout = gfn.RankLayout.from_hostnames(8, 3, 1, 0, block(4, 4))
    assert layout.buffer_ranks == [2, 5, 7] and layout.agent_ranks_per_group == [[0, 1], [3, 4], [6]]
    assert layout.agent_group_rank_list == [[0, 1, 3, 4, 6]]
    with pytest.warns(LayoutWarning, match="span several nodes"):
        gfn.RankLayout.from_hostnames(8, 2, 2, 0, block(5, 3))
    with pytest.warns(LayoutWarning, match="not a multiple of num_nodes=2"):
        gfn.RankLayout.build(8, 2, 2, 3, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gfn.RankLayout.build(8, 2, 2, 1, 0)  # torchgfn warned: 1 is not a multiple of 2 nodes


def test_without_managers_from_host_names_keeps_each_node_together():
    """torchgfn divided by zero here; popmesh keeps each node's ranks in one chunk and its groups on it."""
    layout = gfn.RankLayout.from_hostnames(9, 0, 2, 1, cyclic(2, 9))
    assert layout.agent_ranks_per_group == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.agent_group_rank_list == [[0, 2, 4, 6], [1, 3, 5, 7]] and layout.buffer_ranks == []
    assert layout.assigned_buffer(0) is None and layout.agent_group_id(8) == 0


def test_the_constructor_takes_torchgfns_lists():
    layout = gfn.RankLayout([0, 2, 4, 1, 3, 5], [6, 7], [[0, 2, 4], [1, 3, 5]], 3)
    assert layout.agent_group_rank_list == [[0, 2], [4, 1], [3, 5]] and layout.agent_group_size == 2
    assert layout.assigned_buffer(4) == 6 and layout.assigned_training_ranks(7) == [1, 3, 5]
    assert layout.agent_group_id(4) == 1 and layout.agent_group_id(7) == 1 and layout.agent_group_id(99) == 0
    assert "buffer manager 6 serves training ranks [0, 2, 4]" in layout.summary(2)
    plain = gfn.RankLayout([0, 1, 2], [], [[0, 1], [2]], 1)
    assert plain.assigned_buffer(0) is None and plain.assigned_training_ranks(0) is None


@pytest.mark.parametrize(("make", "words"), [
    (lambda: gfn.RankLayout.build(3, 2, 1, 1, 0), "world_size=3 is too small for 2 buffer manager"),
    (lambda: gfn.RankLayout.build(8, 2, 2, 4, 0), "num_agent_groups=4"),
    (lambda: gfn.RankLayout.build(8, 0, 0, 1, 0), "num_nodes must be an integer >= 1"),
    (lambda: gfn.RankLayout.build(8, 1, 1, 1, 2), "num_coordinators=2: use 0 or 1"),
    (lambda: gfn.RankLayout.from_hostnames(8, 2, 1, 0, block(7, 1)), "node 'node1' has 1 usable rank"),
    (lambda: gfn.RankLayout.from_hostnames(8, 2, 1, 0, block(4)), "one host name per rank of the world_size=8"),
    (lambda: gfn.RankLayout([0, 1], [2], [[0, 1]], 3), "num_agent_groups=3 cannot split 2 training ranks"),
    (lambda: gfn.RankLayout([0, 1], [2, 3], [[0, 1]], 1), "2 buffer ranks but 1 agent_ranks_per_group entries"),
    (lambda: gfn.RankLayout([0, 1], [2], [[0]], 1), "must hold exactly the training ranks"),
    (lambda: gfn.RankLayout([0, 2], [3], [[0, 2]], 1), "have no role"),
    (lambda: gfn.RankLayout([0, "1"], [2], [[0, 1]], 1), "training_ranks must be a list of integer ranks"),
])
def test_bad_input_is_a_config_error_naming_what_to_change(make, words):
    with pytest.raises(ConfigError, match=words):  # a ValueError too, as torchgfn's
        make()


def test_a_layout_fits_the_world_it_is_used_in():
    made_here = gfn.RankLayout([0, 1, 2], [3], [[0, 1, 2]], 1)  # no coordinator among its ranks
    assert native_layout(made_here, 4, False) is made_here.native
    with_coordinator = native_layout(made_here, 5, True)
    assert with_coordinator.coordinator_rank == 4 and with_coordinator.buffer_ranks == (3,)
    built = gfn.RankLayout.build(5, 1, 1, 1, 1)
    assert native_layout(built, 5, True) is built.native
    assert native_layout(built.native, 5, True) is built.native
    with pytest.raises(ConfigError, match="have no role"):
        native_layout(made_here, 6, False)
    with pytest.raises(ConfigError, match=r"this world has 4 ranks and a coordinator"):
        native_layout(NativeLayout.build(5, 1), 4, True)
    with pytest.raises(ConfigError, match="layout must be a RankLayout"):
        native_layout({"training_ranks": [0]}, 1, False)


@pytest.mark.parametrize(("environ", "announced"), [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, ("OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE", 2, 4)),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "3"}, ("MV2_COMM_WORLD_RANK/MV2_COMM_WORLD_SIZE", 1, 3)),
    ({"PMI_RANK": "0", "PMI_SIZE": "5", "RANK": "3", "WORLD_SIZE": "9"}, ("PMI_RANK/PMI_SIZE", 0, 5)),
    ({"PMIX_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, ("PMIX_RANK/OMPI_COMM_WORLD_SIZE", 3, 4)),
    ({"RANK": "1", "WORLD_SIZE": "2"}, None),  # torchrun's or popmesh launch's: not an MPI launch
    ({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, None),  # no MPI size
    ({"OMPI_COMM_WORLD_SIZE": "4"}, None),
    ({}, None),
])
def test_the_rank_and_size_an_mpi_launcher_announced(environ, announced):
    assert announced_by_mpi(environ) == announced
    if announced is not None:
        check_announced(announced[1], announced[2], environ)
        with pytest.raises(ConfigError, match=rf"announce rank {announced[1]} of {announced[2]}, but this world formed "
                                              r"as rank 0 of 1: mpi4py's MPI is not the launcher's"):
            check_announced(0, 1, environ)
    else:
        check_announced(0, 1, environ)


MISMATCH = """
import popmesh.compat.gfn as distributed
from popmesh import ConfigError
try:
    distributed.initialize_distributed_compute("gloo", num_remote_buffers=0)
except ConfigError as e:
    print("REFUSED", e)
"""


@pytest.mark.timeout(60)
def test_a_world_that_is_not_what_open_mpi_announced_is_refused():
    """Open MPI's mpirun announced rank 2 of 4, but the world formed as one of one (what MPICH's mpi4py
    under Open MPI's launcher gives every process): refused, naming the variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MV2_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE")}
    env.update(OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="4", POPMESH_ENGINE="local")
    done = subprocess.run([sys.executable, "-c", MISMATCH], capture_output=True, text=True, timeout=50, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "REFUSED OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE announce rank 2 of 4, but this world formed as rank " \
           "0 of 1" in done.stdout, done.stdout + done.stderr
