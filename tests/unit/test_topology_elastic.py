"""Roles across a change of the world's size (popmesh.topology.elastic): pure, no processes."""

import pytest

from popmesh import ConfigError
from popmesh.topology.elastic import relayout, renumbering
from popmesh.topology.layout import RankLayout

# 3 ranks: agent 0, manager 1, coordinator 2 (what assign_roles gives for one buffer and a coordinator)
SMALL = RankLayout(world_size=3, training_ranks=(0,), buffer_ranks=(1,), served_ranks=((0,),), coordinator_rank=2)


def test_renumbering_follows_launcher_numbers():
    assert renumbering((0, 1, 2), (0, 1, 2, 3, 4)) == {0: 0, 1: 1, 2: 2}
    assert renumbering((0, 1, 2, 3, 4, 5), (1, 2, 3, 4, 5)) == {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}
    assert renumbering((0, 4, 5), (0, 5, 9)) == {0: 0, 2: 1}


def test_newcomers_train_and_the_services_keep_their_processes():
    grown = relayout(SMALL, (0, 1, 2), (0, 1, 2, 3, 4, 5))
    assert grown.training_ranks == (0, 3, 4, 5) and grown.buffer_ranks == (1,) and grown.coordinator_rank == 2
    assert grown.served_ranks == ((0, 3, 4, 5),) and grown.agent_groups == ((0, 3, 4, 5),)


def test_a_leave_moves_every_role_above_it_down():
    grown = relayout(SMALL, (0, 1, 2), (0, 1, 2, 3, 4, 5))
    shrunk = relayout(grown, (0, 1, 2, 3, 4, 5), (1, 2, 3, 4, 5))
    assert shrunk.buffer_ranks == (0,) and shrunk.coordinator_rank == 1
    assert shrunk.training_ranks == (2, 3, 4) and shrunk.served_ranks == ((2, 3, 4),)


def test_a_newcomer_goes_to_the_manager_with_fewest_agents_on_its_host_first():
    two = RankLayout(world_size=5, training_ranks=(0, 1, 3), buffer_ranks=(2, 4), served_ranks=((0, 1), (3,)))
    assert relayout(two, range(5), range(6)).served_ranks == ((0, 1), (3, 5))
    hosts = ["a", "a", "a", "b", "b", "a"]  # the newcomer (rank 5) lives beside manager 2
    assert relayout(two, range(5), range(6), hosts).served_ranks == ((0, 1, 5), (3,))


def test_agent_groups_stay_equal_or_the_change_is_refused_with_what_to_do():
    groups = RankLayout(world_size=4, training_ranks=(0, 1, 2, 3), agent_groups=((0, 1), (2, 3)))
    assert relayout(groups, range(4), range(6)).agent_groups == ((0, 1, 4), (2, 3, 5))
    with pytest.raises(ConfigError, match="multiple of num_agent_groups"):
        relayout(groups, range(4), range(5))


@pytest.mark.parametrize("after, cause", [((0, 2), "manager"), ((0, 1), "coordinator")])
def test_a_service_that_left_for_good_is_named(after, cause):
    with pytest.raises(ConfigError, match=f"{cause}.*launcher rank {({'manager': 1, 'coordinator': 2})[cause]}"
                                          ".*left the world for good"):
        relayout(SMALL, (0, 1, 2), after)


def test_a_manager_left_with_no_agent_or_no_agent_at_all_is_refused():
    two = RankLayout(world_size=5, training_ranks=(0, 1, 3), buffer_ranks=(2, 4), served_ranks=((0, 1), (3,)))
    with pytest.raises(ConfigError, match=r"rank\(s\) \[3\] of the new world would serve no agent"):
        relayout(two, range(5), (0, 1, 2, 4))
    with pytest.raises(ConfigError, match="every training rank left"):
        relayout(SMALL, (0, 1, 2), (1, 2))


def test_the_roster_must_match_the_layout():
    with pytest.raises(ConfigError, match="roster before has 2 ranks but the layout 3"):
        relayout(SMALL, (0, 1), (0, 1, 2))
