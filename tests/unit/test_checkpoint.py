"""Population checkpoints in a world of one: atomic files, a manifest last, torn ones never loaded."""

import json
import random

import numpy as np
import pytest
import torch

import popmesh
from popmesh.core.errors import ConfigError
from popmesh.population.decisions.selection import (
    ReplacementRule,
    init_state,
    state_from_json,
    state_to_json,
    update_state,
)
from popmesh.population.state.checkpoint import (
    MANIFEST,
    AgentState,
    Checkpointer,
    capture_rng,
    latest_checkpoint,
    load_agent,
    missing_ranks,
    read_manifest,
    restore_rng,
)


@pytest.fixture
def agent():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    return model, opt


def _save(tmp_path, model, opt, iterations, keep=2):
    popmesh.init("local")
    saver = Checkpointer(tmp_path, every=10, keep=keep)
    for it in iterations:
        saver.save(it, AgentState(model.state_dict(), opt.state_dict(), {"lr": 0.01}, {"iteration": it}),
                   policy_state={"at": it})
    return saver


def test_the_newest_complete_checkpoints_are_kept_and_loaded(tmp_path, agent):
    model, opt = agent
    saver = _save(tmp_path, model, opt, (10, 20, 30))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000020", "ckpt-000000030"]
    newest = latest_checkpoint(tmp_path)
    assert newest.name == "ckpt-000000030" and read_manifest(newest)["policy_state"] == {"at": 30}
    back = load_agent(newest, 0, 1)
    assert all(torch.equal(back.model[k], v) for k, v in model.state_dict().items())
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(back.optimizer)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert saver.saved == 3 and saver.seconds_spent > 0 and (saver.due(20), saver.due(25), saver.due(0)) == (
        True, False, False)


@pytest.mark.parametrize("damage", ["no manifest", "truncated file", "changed byte", "bad manifest"])
def test_a_torn_checkpoint_is_never_loaded(tmp_path, agent, damage):
    model, opt = agent
    _save(tmp_path, model, opt, (10, 20))
    newest = tmp_path / "ckpt-000000020"
    rank_file = newest / "rank-0.pt"
    if damage == "no manifest":  # killed before rank 0 committed
        (newest / MANIFEST).unlink()
    elif damage == "truncated file":
        rank_file.write_bytes(rank_file.read_bytes()[:100])
    elif damage == "changed byte":
        raw = bytearray(rank_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        rank_file.write_bytes(bytes(raw))
    else:
        (newest / MANIFEST).write_text("{not json")
    assert latest_checkpoint(tmp_path).name == "ckpt-000000010"
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        read_manifest(newest)


def test_a_population_of_another_size_is_refused(tmp_path, agent):
    model, opt = agent
    _save(tmp_path, model, opt, (10,))
    with pytest.raises(ConfigError, match="population of 1 agents, but this world has 4 ranks"):
        load_agent(latest_checkpoint(tmp_path), 0, 4)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="every >= 0 and keep >= 1"):
        Checkpointer("x", every=-1)


def test_random_number_states_come_back():
    gen = np.random.default_rng(3)
    state = capture_rng(gen)
    drawn = (torch.rand(2), gen.random(), random.random())
    restore_rng(state, gen)
    assert torch.equal(torch.rand(2), drawn[0]) and gen.random() == drawn[1] and random.random() == drawn[2]


@pytest.mark.parametrize("rule", [ReplacementRule(ratio=0.25), ReplacementRule(ratio=0.25, age_range=(3, 9))])
def test_selection_state_survives_json(rule):
    state = update_state(init_state(6, rule, rng=5), [1, 4], 12)
    assert state_from_json(json.loads(json.dumps(state_to_json(state)))) == state


def test_a_checkpoint_written_while_a_rank_was_lost_names_it_and_holds_no_agent_of_it(tmp_path, agent):
    """As the survivors' group writes it: the manifest says which of the population's ranks had no agent."""
    model, opt = agent
    _save(tmp_path, model, opt, (10,))
    path = latest_checkpoint(tmp_path)
    manifest = json.loads((path / MANIFEST).read_text())  # a population of 2 whose rank 1 was lost
    (path / MANIFEST).write_text(json.dumps({**manifest, "world_size": 2, "missing": [1]}))
    assert missing_ranks(path) == (1,) and load_agent(path, 0, 2).counters == {"iteration": 10}
    with pytest.raises(ConfigError, match=r"rank 1 was lost when .* was written.*seed_newcomers"):
        load_agent(path, 1, 2)
    assert missing_ranks(latest_checkpoint(_save(tmp_path / "whole", model, opt, (10,)).directory)) == ()


def test_torn_checkpoints_older_than_a_complete_one_are_removed(tmp_path, agent):
    """A save cut short (a survivor left for the re-forming) leaves a folder without a manifest: gone once a
    newer checkpoint is complete; a torn one newer than every complete one is left alone."""
    model, opt = agent
    for torn in ("ckpt-000000005", "ckpt-000000099"):
        (tmp_path / torn).mkdir()
        (tmp_path / torn / "rank-0.pt").write_bytes(b"half")
    _save(tmp_path, model, opt, (10,))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000010", "ckpt-000000099"]
