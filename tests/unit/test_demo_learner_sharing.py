"""The demo's PPO learner learning from other agents' rollouts: V-trace (pure) and iterate(share=...)."""

import numpy as np
import pytest

from popmesh.demo.learner import Hyper, PPOLearner, _gae, _vtrace

pytest.importorskip("gymnasium")


def _rollout(steps=6, envs=3, seed=0):
    rng = np.random.default_rng(seed)
    rew = rng.normal(size=(steps, envs)).astype(np.float32)
    val = rng.normal(size=(steps, envs)).astype(np.float32)
    done = (rng.random((steps, envs)) < 0.2).astype(np.float32)
    last = rng.normal(size=envs).astype(np.float32)
    return rew, val, done, last


def test_on_its_own_policy_v_trace_targets_are_gae_returns():
    rew, val, done, last = _rollout()
    _, target = _vtrace(rew, val, done, last, np.zeros_like(rew), 0.99, 0.95)
    np.testing.assert_allclose(target, _gae(rew, val, done, last, 0.99, 0.95) + val, rtol=1e-5, atol=1e-5)


def test_actions_this_policy_would_not_take_teach_it_nothing():
    rew, val, done, last = _rollout(seed=1)
    adv, target = _vtrace(rew, val, done, last, np.full_like(rew, -50.0), 0.99, 0.95)
    np.testing.assert_allclose(adv, 0.0, atol=1e-6)
    np.testing.assert_allclose(target, val, atol=1e-6)


def test_weights_above_one_are_truncated():
    rew, val, done, last = _rollout(seed=2)
    at_one = _vtrace(rew, val, done, last, np.zeros_like(rew), 0.99, 0.95)
    above = _vtrace(rew, val, done, last, np.full_like(rew, 3.0), 0.99, 0.95)
    for a, b in zip(at_one, above):
        np.testing.assert_array_equal(a, b)


def test_an_agent_trains_on_the_rollouts_it_is_given_in_minibatches_of_its_own_size():
    agent, other = PPOLearner(0, Hyper(num_envs=2, rollout=16)), PPOLearner(1, Hyper(num_envs=2, rollout=16))
    other.iterate()
    seen, steps = [], []
    real_step = agent.optimizer.step
    agent.optimizer.step = lambda *a, **k: (steps.append(1), real_step(*a, **k))[1]

    def share(mine):
        seen.append({k: v.shape for k, v in mine.items()})
        return [other.rollout, other.rollout]

    agent.iterate(share=share)
    assert seen == [{"obs": (16, 2, 4), "act": (16, 2), "logp": (16, 2), "rew": (16, 2), "done": (16, 2),
                     "last": (2, 4)}]
    hp = agent.hyper
    assert len(steps) == hp.epochs * hp.minibatches * 3  # its own rollout and two shared ones
    batch = agent.batch_of(other.rollout)
    assert batch["obs"].shape == (32, 4) and np.array_equal(batch["logp"], other.rollout["logp"].reshape(-1))
    agent.close(), other.close()


def test_without_sharing_an_iteration_is_as_before():
    agent = PPOLearner(0, Hyper(num_envs=2, rollout=16))
    steps = []
    real_step = agent.optimizer.step
    agent.optimizer.step = lambda *a, **k: (steps.append(1), real_step(*a, **k))[1]
    agent.iterate()
    assert len(steps) == agent.hyper.epochs * agent.hyper.minibatches
    agent.close()
