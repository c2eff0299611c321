"""The demo's PPO learner learning from other agents' rollouts: V-trace (pure) and iterate(share=...)."""

import numpy as np
import pytest

from popmesh.demo.learner import Hyper, PPOLearner, _gae, _vtrace

pytest.importorskip("gymnasium")
torch = pytest.importorskip("torch")


def _rollout(steps=6, envs=3, seed=0):
    rng = np.random.default_rng(seed)
    rew = rng.normal(size=(steps, envs)).astype(np.float32)
    val = rng.normal(size=(steps, envs)).astype(np.float32)
    done = (rng.random((steps, envs)) < 0.2).astype(np.float32)
    last = rng.normal(size=envs).astype(np.float32)
    return rew, val, done, last


def test_on_its_own_policy_v_trace_targets_are_gae_returns():
    rew, val, done, last = _rollout()
    _, target, weight = _vtrace(rew, val, done, last, np.zeros_like(rew), 0.99, 0.95)
    np.testing.assert_allclose(target, _gae(rew, val, done, last, 0.99, 0.95) + val, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(weight, 1.0)


def test_actions_this_policy_would_not_take_teach_it_nothing():
    rew, val, done, last = _rollout(seed=1)
    _, target, weight = _vtrace(rew, val, done, last, np.full_like(rew, -50.0), 0.99, 0.95)
    np.testing.assert_allclose(weight, 0.0, atol=1e-6)
    np.testing.assert_allclose(target, val, atol=1e-6)


def test_weights_above_one_are_truncated():
    rew, val, done, last = _rollout(seed=2)
    at_one = _vtrace(rew, val, done, last, np.zeros_like(rew), 0.99, 0.95)
    above = _vtrace(rew, val, done, last, np.full_like(rew, 3.0), 0.99, 0.95)
    for a, b in zip(at_one, above):
        np.testing.assert_array_equal(a, b)


def test_an_agent_trains_on_the_rollouts_it_is_given_in_its_shared_minibatches():
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
    assert len(steps) == hp.epochs * hp.shared_minibatches  # its own rollout and two shared ones, in larger minibatches
    batch = agent.batch_of(other.rollout)
    assert batch["obs"].shape == (32, 4)
    with torch.no_grad():  # the PPO ratio is taken against this agent's own policy, not the sampling agent's
        logits, _ = agent.model(torch.as_tensor(other.rollout["obs"]).reshape(32, 4))
        own = torch.distributions.Categorical(logits=logits).log_prob(torch.as_tensor(other.rollout["act"]).reshape(-1))
    assert np.allclose(batch["logp"], own.numpy()) and not np.allclose(batch["logp"], other.rollout["logp"].reshape(-1))
    agent.close(), other.close()


def test_shared_actions_this_policy_gave_no_chance_keep_the_loss_finite_once_it_takes_them():
    agent, other = PPOLearner(0, Hyper(num_envs=2, rollout=16)), PPOLearner(1, Hyper(num_envs=2, rollout=16))
    other.iterate()
    with torch.no_grad():  # this agent all but never pushes right; the other agent only did
        agent.model.actor[-1].bias.copy_(torch.tensor([200.0, -200.0]))
    pushed_right = {**other.rollout, "act": np.ones_like(other.rollout["act"]),
                    "logp": np.full_like(other.rollout["logp"], np.log(0.5))}
    batch = {k: torch.as_tensor(v) for k, v in agent.batch_of(pushed_right).items()}
    with torch.no_grad():  # within one iteration's updates, it has come to push right
        agent.model.actor[-1].bias.copy_(torch.tensor([-200.0, 200.0]))
    loss = agent._ppo_loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in agent.model.actor.parameters())
    agent.close(), other.close()


def test_without_sharing_an_iteration_is_as_before():
    agent = PPOLearner(0, Hyper(num_envs=2, rollout=16))
    steps = []
    real_step = agent.optimizer.step
    agent.optimizer.step = lambda *a, **k: (steps.append(1), real_step(*a, **k))[1]
    agent.iterate()
    assert len(steps) == agent.hyper.epochs * agent.hyper.minibatches
    agent.close()
