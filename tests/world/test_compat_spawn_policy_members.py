"""spawn_policy's ``coordinator_group_rank`` and ``participant_group_ranks`` (torchgfn's multinode example
after the seed document): what is checked before any group is known, then worlds of 3 and 4 ranks (torch).
The training files (population, buffers, compat) share one world per engine and size."""

import pytest

from workers import compat_spawn_policy_members_worker as worker
from worldtests import world_tests

pytest.importorskip("torch")

import popmesh.compat.spawn_policy as sp
from popmesh import ConfigError
from popmesh.compat._spawn_members import Members, members_of, participants


def builder():
    return None


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"participant_group_ranks": []}, "participant_group_ranks is empty"),
    ({"participant_group_ranks": [0, -1]}, "participant_group_ranks must be a list of group ranks"),
    ({"participant_group_ranks": "01"}, "participant_group_ranks must be a list of group ranks"),
    ({"coordinator_group_rank": -1}, "coordinator_group_rank must be a group rank"),
    ({"coordinator_group_rank": 1.0}, "coordinator_group_rank must be a group rank"),
])
def test_arguments_are_checked_when_the_policy_is_made(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        sp.AsyncSelectiveAveragingPolicy(builder, 1, **kwargs)


def test_the_new_arguments_come_in_masters_order_after_cooldown():
    positional = sp.AsyncSelectiveAveragingPolicy(builder, 5, 0.5, "best_only", 0.1, 0.02, 1.0, 7, 2, [2, 0], {})
    assert (positional.replacement_ratio, positional.averaging_strategy, positional.cooldown) == (0.5, "best_only", 7)
    assert (positional.coordinator_group_rank, positional.participant_group_ranks, positional.timing) == (2, [2, 0], {})
    assert positional.num_training_ranks is None  # known from the first call
    keywords = sp.AsyncSelectiveAveragingPolicy(builder, 5, timing={}, num_training_ranks=4)
    assert keywords.coordinator_group_rank == 0 and keywords.participant_group_ranks is None
    assert keywords.timing == {} and keywords.num_training_ranks == 4


def test_group_ranks_become_the_groups_global_ranks():
    """A group of global ranks 3, 5, 6, 9: group ranks are positions in it; the participants' group keeps
    this rank's membership, and is the group itself when everyone takes part."""
    from types import SimpleNamespace

    world = SimpleNamespace(rank=5)
    group = SimpleNamespace(ranks=(3, 5, 6, 9), size=4, rank=5, handle="group-handle", world=world)
    assert members_of(group, 0, None) == Members((3, 5, 6, 9), 3)
    chosen = members_of(group, 3, (0, 2))
    assert chosen == Members((3, 6), 9) and not chosen.coordinator_participates
    assert members_of(group, 1, (1, 3)).coordinator_participates
    assert participants(group, members_of(group, 2, None)) is group
    view = participants(group, chosen)
    assert view.ranks == (3, 6) and view.size == 2 and not view.is_member  # rank 5 does not take part
    assert participants(group, Members((5, 9), 3)).is_member
    with pytest.raises(ConfigError, match=r"coordinator_group_rank=4 is not a rank of the group of 4 .*0\.\.3"):
        members_of(group, 4, None)
    with pytest.raises(ConfigError, match=r"participant_group_ranks has \[4, 7\], not ranks of the group of 4"):
        members_of(group, 0, (1, 4, 7))


world_run, test_on_a_world, test_world_exits_cleanly = world_tests(
    worker, [("torch", 3), ("torch", 4)], timeout=120, suite="training",
)
