"""examples/hypergrid_agent.py's agent learning from other agents' trajectories: the arrays they travel
as rebuild the same trajectories, and one step trains on its own and theirs together."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gfn")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from hypergrid_agent import Agent, Grid, trajectory_arrays


@pytest.fixture(scope="module")
def grid():
    return Grid(2, 8, 0.1)


def test_trajectories_rebuilt_from_their_arrays_give_the_same_loss(grid):
    agent = Agent(grid, seed=0, rank=0, lr=1e-3)
    trajectories = agent.sample()
    rebuilt = agent.trajectories_from(trajectory_arrays(trajectories))
    assert len(rebuilt) == len(trajectories)
    assert torch.equal(rebuilt.terminating_states.tensor, trajectories.terminating_states.tensor)
    on_sampled = agent.gflownet.loss(grid.env, trajectories, recalculate_all_logprobs=False)
    on_rebuilt = agent.gflownet.loss(grid.env, rebuilt, recalculate_all_logprobs=True)
    assert float(on_rebuilt) == pytest.approx(float(on_sampled), rel=1e-6)


def test_one_step_trains_on_its_own_trajectories_and_the_shared_ones(grid):
    agent, other = Agent(grid, seed=0, rank=0, lr=1e-3), Agent(grid, seed=0, rank=1, lr=1e-3)
    mine, theirs = agent.sample(), other.sample()
    together = agent.trajectories_from(trajectory_arrays(mine))
    together.extend(agent.trajectories_from(trajectory_arrays(theirs)))
    expected = float(agent.gflownet.loss(grid.env, together, recalculate_all_logprobs=True))
    alone = float(agent.gflownet.loss(grid.env, mine, recalculate_all_logprobs=False))
    steps = []
    real_step = agent.optimizer.step
    agent.optimizer.step = lambda *a, **k: (steps.append(1), real_step(*a, **k))[1]
    loss = agent.learn(mine, [trajectory_arrays(theirs)])
    assert loss == pytest.approx(expected, rel=1e-6) and loss != pytest.approx(alone, rel=1e-6)
    assert steps == [1]
    assert len(mine) == agent.batch_size  # its own trajectories are left as they were sampled
