"""RankLayout: role partition, agent<->manager round trip, agent groups, hostname placement, errors."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popmesh.core.errors import ConfigError
from popmesh.topology.layout import LayoutWarning, RankLayout


def check_invariants(layout: RankLayout) -> None:
    """The contract every layout keeps, whatever built it."""
    world = range(layout.world_size)
    roles = {r: layout.role(r) for r in world}
    assert [r for r in world if roles[r] == "training"] == list(layout.training_ranks)
    assert sorted(r for r in world if roles[r] == "buffer") == sorted(layout.buffer_ranks)
    coordinators = [r for r in world if roles[r] == "coordinator"]
    assert coordinators == ([] if layout.coordinator_rank is None else [layout.world_size - 1])
    assert layout.num_training_ranks + layout.num_buffers + len(coordinators) == layout.world_size
    for rank in world:
        assert 0 <= layout.agent_group_id(rank) < layout.num_agent_groups
        if roles[rank] != "buffer":
            assert layout.assigned_training_ranks(rank) is None
        if roles[rank] != "training":
            assert layout.assigned_buffer(rank) is None
    for agent in layout.training_ranks:
        manager = layout.assigned_buffer(agent)
        if layout.num_buffers == 0:
            assert manager is None
        else:
            assert layout.role(manager) == "buffer"
            assert agent in layout.assigned_training_ranks(manager)
        assert agent in layout.agent_groups[layout.agent_group_id(agent)]
    served = [a for m in layout.buffer_ranks for a in layout.assigned_training_ranks(m)]
    assert sorted(served) == (list(layout.training_ranks) if layout.num_buffers else [])
    members = [r for g in layout.agent_groups for r in g]
    assert sorted(members) == list(layout.training_ranks)
    assert {len(g) for g in layout.agent_groups} == {layout.agent_group_size}
    assert RankLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def expected_valid(world: int, buffers: int, groups: int, coordinator: bool) -> bool:
    training = world - buffers - int(coordinator)
    return training >= max(1, buffers) and training % groups == 0


# --- build -----------------------------------------------------------------------------------


def test_seed_example_world8_two_buffers():
    layout = RankLayout.build(8, num_buffers=2)
    assert layout.buffer_ranks == (3, 7)
    assert layout.assigned_training_ranks(3) == [0, 1, 2]
    assert layout.assigned_training_ranks(7) == [4, 5, 6]
    assert [layout.assigned_buffer(a) for a in (0, 1, 2, 4, 5, 6)] == [3, 3, 3, 7, 7, 7]
    assert layout.coordinator_rank is None
    check_invariants(layout)


def test_coordinator_is_last_rank_outside_chunks():
    layout = RankLayout.build(9, num_buffers=2, use_coordinator=True)
    assert layout.coordinator_rank == 8 and layout.role(8) == "coordinator"
    assert layout.buffer_ranks == (3, 7)
    assert layout.assigned_buffer(8) is None and layout.agent_group_id(8) == 0
    check_invariants(layout)


def test_default_has_no_buffers_and_steals_no_rank():
    layout = RankLayout.build(4)
    assert layout.training_ranks == (0, 1, 2, 3) and layout.buffer_ranks == ()
    assert all(layout.assigned_buffer(r) is None for r in range(4))


def test_ceil_floor_split_of_agents_over_managers():
    layout = RankLayout.build(10, num_buffers=3)  # 7 agents -> 3, 2, 2
    assert layout.buffer_ranks == (3, 6, 9)
    assert [layout.assigned_training_ranks(m) for m in (3, 6, 9)] == [[0, 1, 2], [4, 5], [7, 8]]


def test_agent_groups_are_consecutive_slices_and_managers_report_served_group():
    layout = RankLayout.build(12, num_buffers=3, num_agent_groups=3)
    assert layout.agent_groups == ((0, 1, 2), (4, 5, 6), (8, 9, 10))
    assert [layout.agent_group_id(m) for m in (3, 7, 11)] == [0, 1, 2]
    assert layout.agent_group_size == 3 and layout.num_agent_groups == 3


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16])
@pytest.mark.parametrize("buffers", [0, 1, 2, 3])
@pytest.mark.parametrize("coordinator", [False, True])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_build_matrix(world, buffers, coordinator, groups):
    if not expected_valid(world, buffers, groups, coordinator):
        with pytest.raises(ConfigError):
            RankLayout.build(world, buffers, groups, coordinator)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout = RankLayout.build(world, buffers, groups, coordinator)
    check_invariants(layout)
    assert layout.num_agent_groups == groups


@settings(max_examples=150, deadline=None)
@given(world=st.integers(1, 64), buffers=st.integers(0, 8), groups=st.integers(1, 6), coordinator=st.booleans())
def test_build_property(world, buffers, groups, coordinator):
    if not expected_valid(world, buffers, groups, coordinator):
        with pytest.raises(ConfigError):
            RankLayout.build(world, buffers, groups, coordinator)
    else:
        check_invariants(RankLayout.build(world, buffers, groups, coordinator))


# --- errors ------------------------------------------------------------------------------------


def test_too_small_world_says_how_many_ranks_are_needed():
    with pytest.raises(ConfigError, match="at least 5 ranks"):
        RankLayout.build(4, num_buffers=2, use_coordinator=True)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        RankLayout.build(1, use_coordinator=True)


def test_indivisible_agent_groups_lists_divisors():
    with pytest.raises(ConfigError, match=r"num_agent_groups in \[1, 7\]"):
        RankLayout.build(8, num_buffers=1, num_agent_groups=2)


@pytest.mark.parametrize("kwargs", [
    dict(world_size=0), dict(world_size=-3), dict(world_size=4, num_buffers=-1),
    dict(world_size=4, num_agent_groups=0), dict(world_size=4, num_nodes=0),
    dict(world_size=True), dict(world_size=4.0), dict(world_size=4, use_coordinator=1),
])
def test_bad_counts_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        RankLayout.build(**kwargs)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        RankLayout.build(2, num_buffers=2)


def test_queries_reject_ranks_outside_the_world():
    layout = RankLayout.build(4, num_buffers=1)
    for bad in (-1, 4, True):
        for query in (layout.role, layout.assigned_buffer, layout.assigned_training_ranks, layout.agent_group_id):
            with pytest.raises(ConfigError, match="not a rank"):
                query(bad)


# --- warnings ----------------------------------------------------------------------------------


def test_build_warns_when_agent_groups_must_span_nodes():
    with pytest.warns(LayoutWarning, match="span nodes"):
        RankLayout.build(12, num_agent_groups=2, num_nodes=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RankLayout.build(12, num_agent_groups=1, num_nodes=3)
        RankLayout.build(12, num_agent_groups=6, num_nodes=3)


# --- from_hostnames ------------------------------------------------------------------------------


def block_hosts(world: int, nodes: int) -> list[str]:
    per_node = -(-world // nodes)
    return [f"node{r // per_node}" for r in range(world)]


def cyclic_hosts(world: int, nodes: int) -> list[str]:
    return [f"node{r % nodes}" for r in range(world)]


def assert_node_local(layout: RankLayout, hosts: list[str]) -> None:
    for manager in layout.buffer_ranks:
        assert {hosts[a] for a in layout.assigned_training_ranks(manager)} == {hosts[manager]}


@pytest.mark.parametrize("hosts", [block_hosts, cyclic_hosts])
@pytest.mark.parametrize("world,nodes,buffers,coordinator", [
    (8, 2, 2, False), (9, 2, 2, True), (16, 4, 4, True), (16, 2, 4, False), (12, 3, 6, False), (10, 2, 2, True),
])
def test_from_hostnames_places_managers_on_their_agents_node(hosts, world, nodes, buffers, coordinator):
    names = hosts(world, nodes)
    layout = RankLayout.from_hostnames(names, num_buffers=buffers, use_coordinator=coordinator)
    check_invariants(layout)
    assert_node_local(layout, names)
    assert layout.num_buffers == buffers
    assert layout.coordinator_rank == (world - 1 if coordinator else None)


@pytest.mark.parametrize("hosts", [block_hosts, cyclic_hosts])
def test_production_layout_127_ranks_4_nodes_4_managers_coordinator(hosts):
    names = hosts(127, 4)
    layout = RankLayout.from_hostnames(names, num_buffers=4, use_coordinator=True)
    check_invariants(layout)
    assert_node_local(layout, names)
    assert layout.coordinator_rank == 126 and layout.num_training_ranks == 122
    assert len({names[m] for m in layout.buffer_ranks}) == 4
    expected = (31, 63, 95, 125) if hosts is block_hosts else (124, 125, 122, 123)
    assert layout.buffer_ranks == expected
    assert "4 buffer manager(s), coordinator rank 126" in layout.summary(num_nodes=4)


def test_from_hostnames_block_matches_seed_example():
    names = ["a"] * 4 + ["b"] * 4
    assert RankLayout.from_hostnames(names, num_buffers=2) == RankLayout.build(8, num_buffers=2)


def test_uneven_nodes_split_ceil_floor():
    names = ["a"] * 5 + ["b"] * 3
    layout = RankLayout.from_hostnames(names, num_buffers=2)
    assert layout.buffer_ranks == (4, 7)
    assert layout.assigned_training_ranks(4) == [0, 1, 2, 3]
    assert layout.assigned_training_ranks(7) == [5, 6]


def test_nodes_ordered_by_lowest_rank_not_by_name():
    names = ["zeta", "alpha", "zeta", "alpha"]
    layout = RankLayout.from_hostnames(names, num_buffers=2)
    assert layout.buffer_ranks == (2, 3)  # zeta holds rank 0, so its manager comes first


def test_fallback_to_build_with_warning_when_buffers_do_not_divide_over_nodes():
    names = block_hosts(12, 2)
    with pytest.warns(LayoutWarning, match="not a multiple"):
        layout = RankLayout.from_hostnames(names, num_buffers=3)
    assert layout == RankLayout.build(12, num_buffers=3)


def test_too_small_node_names_the_node():
    with pytest.raises(ConfigError, match=r"node 'b' has 1 usable rank.*at least 2"):
        RankLayout.from_hostnames(["a", "a", "a", "b"], num_buffers=2)
    with pytest.raises(ConfigError, match="at least 2"):  # b's second rank is the coordinator
        RankLayout.from_hostnames(["a", "a", "a", "b", "b"], num_buffers=2, use_coordinator=True)


def test_without_buffers_agent_groups_stay_node_local_under_cyclic_placement():
    names = cyclic_hosts(8, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout = RankLayout.from_hostnames(names, num_agent_groups=2)
    assert layout.agent_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    check_invariants(layout)


def test_warns_when_agent_groups_span_nodes():
    with pytest.warns(LayoutWarning, match="span several nodes"):
        RankLayout.from_hostnames(block_hosts(127, 4), num_buffers=4, num_agent_groups=2, use_coordinator=True)


def test_from_hostnames_rejects_non_strings():
    with pytest.raises(ConfigError, match="hostnames"):
        RankLayout.from_hostnames("node0")
    with pytest.raises(ConfigError, match="world_size"):
        RankLayout.from_hostnames([])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), world=st.integers(1, 40), nodes=st.integers(1, 4), buffers=st.integers(0, 8),
       groups=st.integers(1, 4), coordinator=st.booleans())
def test_from_hostnames_property(data, world, nodes, buffers, groups, coordinator):
    names = data.draw(st.lists(st.sampled_from([f"h{i}" for i in range(nodes)]), min_size=world, max_size=world))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayoutWarning)
        try:
            layout = RankLayout.from_hostnames(names, buffers, groups, coordinator)
        except ConfigError:
            return
    check_invariants(layout)
    assert layout.num_buffers == buffers and layout.num_agent_groups == groups
    if buffers % len(set(names)) == 0:
        assert_node_local(layout, names)


# --- data: to_dict / from_dict / summary ----------------------------------------------------------


def test_to_dict_is_json_and_round_trips():
    layout = RankLayout.from_hostnames(cyclic_hosts(13, 2), num_buffers=2, num_agent_groups=1, use_coordinator=True)
    text = json.dumps(layout.to_dict())
    assert RankLayout.from_dict(json.loads(text)) == layout


@pytest.mark.parametrize("patch,match", [
    (dict(training_ranks=[0, 1, 2, 3]), "more than one role"),
    (dict(training_ranks=[0, 1]), r"ranks \[2\] have no role"),
    (dict(training_ranks=[0, 1, 2, 9]), "outside the world"),
    (dict(served_ranks=[[0, 1]]), "exactly one buffer manager"),
    (dict(served_ranks=[]), "served_ranks entries"),
    (dict(agent_groups=[[0, 1], [2]]), "equal size"),
    (dict(agent_groups=[[0, 1], [1, 2]]), "partition the training ranks"),
    (dict(training_ranks="0,1,2"), "list of integer ranks"),
    (dict(coordinator_rank="3"), "coordinator_rank"),
])
def test_from_dict_validates(patch, match):
    data = {**RankLayout.build(4, num_buffers=1).to_dict(), **patch}
    with pytest.raises(ConfigError, match=match):
        RankLayout.from_dict(data)


def test_from_dict_rejects_missing_and_unknown_keys():
    data = RankLayout.build(4).to_dict()
    del data["agent_groups"]
    with pytest.raises(ConfigError, match=r"missing keys \['agent_groups'\]"):
        RankLayout.from_dict(data)
    with pytest.raises(ConfigError, match="unknown keys"):
        RankLayout.from_dict({**RankLayout.build(4).to_dict(), "extra": 1})
    with pytest.raises(ConfigError, match="mapping"):
        RankLayout.from_dict([1, 2])


def test_numpy_integers_are_accepted_and_stored_as_int():
    np = pytest.importorskip("numpy")
    layout = RankLayout.build(np.int64(8), num_buffers=np.int32(2))
    assert layout.assigned_buffer(np.int64(0)) == 3 and type(layout.world_size) is int
    direct = RankLayout(np.int64(3), training_ranks=[np.int64(0), np.int64(1)], coordinator_rank=np.int64(2))
    assert json.loads(json.dumps(direct.to_dict()))["training_ranks"] == [0, 1]


def test_layout_is_frozen_and_hashable():
    layout = RankLayout.build(8, num_buffers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.world_size = 9
    assert hash(layout) == hash(RankLayout.build(8, num_buffers=2))


def test_summary_lists_managers_and_groups():
    text = RankLayout.build(9, num_buffers=2, use_coordinator=True).summary(num_nodes=2)
    assert text.splitlines() == [
        "9 rank(s) on 2 node(s): 6 training, 2 buffer manager(s), coordinator rank 8; 1 agent group(s) of 6.",
        "  buffer manager 3 serves training ranks [0-2]",
        "  buffer manager 7 serves training ranks [4-6]",
        "  agent group 0: training ranks [0-2, 4-6]",
    ]
