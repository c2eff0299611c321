"""A small PPO learner for a gymnasium task with discrete actions (CartPole-v1, Acrobot-v1) on vectorised
environments: one agent per rank in the demo.

Deliberately compact: the demo is about what popmesh does between agents, not about RL tricks. Each
``iterate()`` collects ``rollout`` steps from ``num_envs`` environments, then runs a few epochs of
clipped PPO. Hyper-parameters are a small dataclass so a population can perturb them; the two it
explores (the learning rate and the entropy coefficient) ride along with the weights as buffers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

__all__ = ["EXPLORED", "Hyper", "IterationStats", "PPOLearner", "CartPoleLearner", "build_policy"]

EXPLORED = ("lr", "ent_coef")  # the hyper-parameters carried by the model as buffers (log scale)


@dataclass
class Hyper:
    """Per-agent hyper-parameters (the population varies ``lr`` and ``entropy``, the entropy coefficient
    that ``--explore`` calls ``ent_coef``)."""

    lr: float = 2.5e-3
    entropy: float = 0.01
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    epochs: int = 4
    minibatches: int = 4
    # minibatches per epoch when other agents' rollouts join the batch (up to four times the data): one
    # step per rollout took Acrobot to the target soonest and made CartPole collapse more often; as many
    # steps as alone did the reverse; twice as many steps did best on both (cartpole-wide and
    # acrobot-wide, 10 seeds each)
    shared_minibatches: int = 8
    num_envs: int = 8
    rollout: int = 64
    hidden: int = 64

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class IterationStats:
    """What one iteration did: env steps taken, episodes finished with their returns, PPO loss."""

    steps: int
    episode_returns: list[float] = field(default_factory=list)
    loss: float = 0.0


def build_policy(hidden: int, lr: float = 2.5e-3, ent_coef: float = 0.01, observations: int = 4,
                 actions: int = 2) -> Any:
    """Actor-critic MLP (CartPole: 4 observations, 2 actions; Acrobot: 6 and 3). The learning rate and
    the entropy coefficient ride along as buffers (``log_lr``, ``log_ent_coef``), so a population policy
    that averages weights and buffers also passes them on (their geometric mean, for several donors).
    The returns of the last 20 episodes ride along too (``recent_returns``, NaN where none yet), so an
    agent that takes these weights takes the metric they earned."""
    import math

    import torch
    import torch.nn as nn

    class ActorCritic(nn.Module):
        """Separate actor and critic: a shared body lets the large value loss drown the policy."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("log_lr", torch.tensor(math.log(lr), dtype=torch.float32))
            no_bonus = -math.inf  # an entropy coefficient of 0 (exp(-inf) = 0)
            self.register_buffer("log_ent_coef", torch.tensor(math.log(ent_coef) if ent_coef > 0 else no_bonus,
                                                              dtype=torch.float32))
            self.register_buffer("recent_returns", torch.full((WINDOW,), math.nan))
            self.actor = nn.Sequential(nn.Linear(observations, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                       nn.Tanh(), nn.Linear(hidden, actions))
            self.critic = nn.Sequential(nn.Linear(observations, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                        nn.Tanh(), nn.Linear(hidden, 1))

        def forward(self, obs: Any) -> tuple[Any, Any]:
            return self.actor(obs), self.critic(obs).squeeze(-1)

    return ActorCritic()


WINDOW = 20  # the episodes whose mean return is an agent's metric (and its target)


class PPOLearner:
    """One PPO agent with its own environments (``env``: a gymnasium id with a vector observation and
    discrete actions), model and optimizer."""

    def __init__(self, seed: int, hyper: Hyper | None = None, init_seed: int | None = None,
                 env: str = "CartPole-v1") -> None:
        """``init_seed`` seeds the initial weights (shared across a population, so that averaging
        agents averages networks from one basin); ``seed`` seeds the environments and sampling."""
        import gymnasium as gym
        import torch

        self.hyper = Hyper() if hyper is None else replace(hyper)  # a copy: adopt_hyper() writes to it
        self.seed, self.env = seed, env
        self.envs = gym.make_vec(
            env, num_envs=self.hyper.num_envs, vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
        self.observations = int(np.prod(self.envs.single_observation_space.shape or (1,)))
        actions = int(self.envs.single_action_space.n)  # type: ignore[attr-defined]  # Discrete: the demo's tasks
        torch.manual_seed(seed if init_seed is None else init_seed)
        self.model = build_policy(self.hyper.hidden, self.hyper.lr, self.hyper.entropy, self.observations, actions)
        torch.manual_seed(seed)
        self.obs, _ = self.envs.reset(seed=seed)
        self.optimizer = self.make_optimizer(self.model)
        self.adopt_hyper()  # the values as the model carries them (float32), everywhere
        self.running = np.zeros(self.hyper.num_envs)
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.total_steps = 0
        self.rollout: dict[str, np.ndarray] = {}  # the last one collected, as other agents learn from it (batch_of)
        self.shared_rollouts = 0  # other agents' rollouts trained on (iterate(share=...))

    def make_optimizer(self, model: Any) -> Any:
        """A fresh Adam for ``model`` at the model's own learning rate (the population's builder)."""
        import torch

        return torch.optim.Adam(model.parameters(), lr=float(model.log_lr.exp()), eps=1e-5)

    def learning_rate(self) -> float:
        """The learning rate carried by the model (its ``log_lr`` buffer)."""
        return float(self.model.log_lr.exp())

    def explored(self) -> dict[str, float]:
        """The explored hyper-parameters as the model carries them: ``{"lr": ..., "ent_coef": ...}``."""
        return {name: float(getattr(self.model, f"log_{name}").exp()) for name in EXPLORED}

    def adopt_hyper(self) -> None:
        """After the population replaced this agent's weights (buffers included), train at the learning
        rate and entropy coefficient that came with them: PBT's exploit, through the same weight exchange."""
        values = self.explored()
        self.hyper.lr, self.hyper.entropy = values["lr"], values["ent_coef"]
        for group in self.optimizer.param_groups:
            group["lr"] = values["lr"]

    def set_hyper(self, **values: float) -> None:
        """Train at these explored values from now on (``lr=``, ``ent_coef=``): the model's buffers (so
        they travel with the weights), the hyper-parameters and the optimizer all take them."""
        import math

        import torch

        unknown = sorted(set(values) - set(EXPLORED))
        if unknown:
            raise ValueError(f"set_hyper: {unknown} are not carried by the model; known: {list(EXPLORED)}")
        with torch.no_grad():
            for name, value in values.items():
                getattr(self.model, f"log_{name}").fill_(math.log(value) if value > 0 else -math.inf)
        self.adopt_hyper()

    def set_learning_rate(self, lr: float) -> None:
        """:meth:`set_hyper` for the learning rate alone."""
        self.set_hyper(lr=lr)

    def checkpoint(self, iteration: int, extra: dict[str, Any] | None = None) -> Any:
        """This agent as a population checkpoint holds it (:class:`popmesh.population.state.checkpoint.AgentState`)."""
        from popmesh.population.state.checkpoint import AgentState, capture_rng

        return AgentState(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
                          hyper=self.hyper.to_dict(), counters={"iteration": iteration, "steps": self.total_steps},
                          rng=capture_rng(), extra={"recent": list(self.recent), "env": self.env, **(extra or {})})

    def restore(self, agent: Any) -> int:
        """Take back an :class:`AgentState` from :meth:`checkpoint`; the iteration it was taken at. The
        environments start fresh episodes (their state is not checkpointed), seeded by that iteration."""
        from popmesh.core.errors import ConfigError
        from popmesh.population.state.checkpoint import restore_rng

        trained = agent.extra.get("env", "CartPole-v1")
        if trained != self.env:
            raise ConfigError(f"--resume: that checkpoint's agents trained on {trained}, this run on {self.env}: "
                              f"give --env {trained}")
        self.model.load_state_dict(agent.model)
        self.hyper = Hyper(**agent.hyper)
        self.optimizer = self.make_optimizer(self.model)
        self.optimizer.load_state_dict(agent.optimizer)
        self.total_steps = int(agent.counters["steps"])
        self.recent.extend(float(r) for r in agent.extra.get("recent", ()))
        restore_rng(agent.rng)
        iteration = int(agent.counters["iteration"])
        self.obs, _ = self.envs.reset(seed=self.seed + 7919 * iteration)
        self.running = np.zeros(self.hyper.num_envs)
        return iteration

    def publish_returns(self) -> None:
        """Write the last episodes' returns into the model's ``recent_returns`` buffer, so that they travel
        with the weights: an agent that takes another's weights takes the returns they earned."""
        import torch

        values = torch.full((WINDOW,), math.nan)
        values[:len(self.recent)] = torch.tensor(list(self.recent), dtype=torch.float32)
        self.model.recent_returns.copy_(values)

    def adopt_returns(self) -> None:
        """After the population replaced this agent's weights: its metric is the returns that came with
        them (the donor's; their mean over the window for several donors), not those of the weights it
        no longer has."""
        came = [float(v) for v in self.model.recent_returns if math.isfinite(float(v))]
        self.recent.clear()
        self.recent.extend(came)

    def mean_return(self) -> float:
        """Mean return of the last 20 finished episodes (NaN before the first one)."""
        return float(np.mean(self.recent)) if self.recent else float("nan")

    def score(self, last: int = 0) -> float:
        """What the population compares: :meth:`mean_return`, or with ``last`` the mean return of the last
        ``last`` episodes (a selection that sees a recent collapse or jump sooner than the 20-episode
        metric); before the first episode has finished (Acrobot's first ones last 500 steps, 8
        iterations) the mean return so far of the unfinished ones. Finite either way."""
        if not self.recent:
            return float(np.mean(self.running))
        return float(np.mean(list(self.recent)[-last:])) if last else self.mean_return()

    def iterate(self, timer: Any = None, share: Callable[[dict[str, np.ndarray]], list[Any]] | None = None
                ) -> IterationStats:
        """Collect one rollout and train on it (timed as ``rollout`` and ``train`` when given a Timer). With
        ``share`` (:meth:`popmesh.population.mechanisms.sharing.SampleSharing.exchange`), this agent's
        rollout goes to the other agents and it trains on theirs too (:meth:`batch_of`): the PPO ratio is
        taken against this agent's own policy, and the advantages are this agent's critic's."""
        with _section(timer, "rollout"):
            batch, finished = self._collect()
        others: list[dict[str, np.ndarray]] = []
        if share is not None:
            with _section(timer, "share"):
                others = [self.batch_of(rollout) for rollout in share(self.rollout)]
                if others:
                    batch = {k: np.concatenate([batch[k], *(other[k] for other in others)]) for k in batch}
                self.shared_rollouts += len(others)
        with _section(timer, "train"):
            loss = self._train(batch, self.hyper.shared_minibatches if others else self.hyper.minibatches)
        steps = self.hyper.rollout * self.hyper.num_envs
        self.total_steps += steps
        self.publish_returns()
        return IterationStats(steps, finished, loss)

    def _collect(self) -> tuple[dict[str, Any], list[float]]:
        import torch

        hp, n = self.hyper, self.hyper.num_envs
        obs_buf = np.zeros((hp.rollout, n, self.observations), np.float32)
        act_buf, logp_buf, val_buf, rew_buf, done_buf = (np.zeros((hp.rollout, n), np.float32) for _ in range(5))
        finished: list[float] = []
        with torch.no_grad():
            for t in range(hp.rollout):
                logits, value = self.model(torch.as_tensor(self.obs, dtype=torch.float32))
                dist = torch.distributions.Categorical(logits=logits)
                action = dist.sample()  # type: ignore[no-untyped-call]  # torch: Categorical's methods are unannotated
                obs_buf[t], act_buf[t], logp_buf[t], val_buf[t] = self.obs, action, dist.log_prob(action), value  # type: ignore[no-untyped-call]  # torch: Categorical's methods are unannotated
                self.obs, reward, term, trunc, _ = self.envs.step(action.numpy())
                rew_buf[t], done_buf[t] = reward, np.logical_or(term, trunc)
                finished.extend(self._track_returns(reward, done_buf[t]))
            _, last_value = self.model(torch.as_tensor(self.obs, dtype=torch.float32))
        self.rollout = {"obs": obs_buf, "act": act_buf, "logp": logp_buf, "rew": rew_buf, "done": done_buf,
                        "last": np.asarray(self.obs, np.float32)}
        adv = _gae(rew_buf, val_buf, done_buf, last_value.numpy(), hp.gamma, hp.lam)
        return _flat({"obs": obs_buf, "act": act_buf, "logp": logp_buf, "adv": adv, "ret": adv + val_buf,
                      "weight": np.ones_like(adv)}), finished

    def batch_of(self, rollout: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A training batch from another agent's :attr:`rollout` (observations, actions, their log-probabilities
        under that agent, rewards, ends, the observations after), off-policy corrected: the value targets and
        advantages are V-trace's (IMPALA, Espeholt et al. 2018) with this agent's critic and importance
        weights truncated at 1 (they weigh the advantages), and the PPO ratio is taken against this agent's own
        policy before the update (decoupled PPO, Hilton et al. 2022): the trust region stays around this
        agent's policy, however far the sampling agent's lies.
        Plain GAE here would fit this agent's critic to the other agent's returns: with learning rates
        apart by decades it took up to 3.2 times V-trace's steps, in one trial more than learning alone."""
        import torch

        hp = self.hyper
        steps, envs = rollout["rew"].shape
        with torch.no_grad():
            logits, values = self.model(torch.as_tensor(rollout["obs"]).reshape(steps * envs, -1))
            _, last = self.model(torch.as_tensor(rollout["last"]))
            dist = torch.distributions.Categorical(logits=logits)
            mine = dist.log_prob(torch.as_tensor(rollout["act"]).reshape(-1))  # type: ignore[no-untyped-call]  # torch: Categorical's methods are unannotated
        value = values.numpy().reshape(steps, envs)
        log_rho = mine.numpy().reshape(steps, envs) - rollout["logp"]
        adv, target, weight = _vtrace(rollout["rew"], value, rollout["done"], last.numpy(), log_rho, hp.gamma, hp.lam)
        return _flat({"obs": rollout["obs"], "act": rollout["act"], "logp": mine.numpy().reshape(steps, envs),
                      "adv": adv, "ret": target, "weight": weight})

    def _track_returns(self, reward: np.ndarray, done: np.ndarray) -> list[float]:
        self.running += reward
        ended = [float(r) for r in self.running[done > 0]]
        self.recent.extend(ended)
        self.running[done > 0] = 0.0
        return ended

    def _train(self, batch: dict[str, np.ndarray], minibatches: int) -> float:
        import torch

        hp = self.hyper
        data = {k: torch.as_tensor(v) for k, v in batch.items()}
        size = data["obs"].shape[0]
        per = size // minibatches
        loss_value = 0.0
        for _ in range(hp.epochs):
            order = torch.randperm(size)
            for start in range(0, size, per):
                idx = order[start : start + per]
                loss = self._ppo_loss({k: v[idx] for k, v in data.items()})
                self.optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
                self.optimizer.step()
                loss_value = float(loss.detach())
        return loss_value

    def _ppo_loss(self, mb: dict[str, Any]) -> Any:
        import torch

        hp = self.hyper
        logits, value = self.model(mb["obs"])
        dist = torch.distributions.Categorical(logits=logits)
        # capped: a shared sample this policy gave almost no chance would overflow the ratio, and inf times an
        # advantage of 0 is NaN; past e^20 the clipped term has long taken over
        log_ratio = (dist.log_prob(mb["act"]) - mb["logp"]).clamp(max=20.0)  # type: ignore[no-untyped-call]  # torch: Categorical's methods are unannotated
        ratio = torch.exp(log_ratio)
        adv = (mb["adv"] - mb["adv"].mean()) / (mb["adv"].std() + 1e-8)
        # each sample weighs by its truncated importance weight (1 on this agent's own rollout), after the
        # advantages were normalised: a shared sample this policy would not take teaches it nothing
        policy = -(mb["weight"] * torch.min(ratio * adv, ratio.clamp(1 - hp.clip, 1 + hp.clip) * adv)).mean()
        return policy + 0.5 * ((value - mb["ret"]) ** 2).mean() - hp.entropy * dist.entropy().mean()  # type: ignore[no-untyped-call]  # torch: Categorical's methods are unannotated

    def close(self) -> None:
        self.envs.close()


CartPoleLearner = PPOLearner  # its name where CartPole was the only task (benchmarks/ use it)


def _section(timer: Any, name: str) -> Any:
    return timer.section(name) if timer is not None else nullcontext()


def _flat(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A batch of (steps, envs, ...) arrays as (steps * envs, ...): one row per transition."""
    return {k: v.reshape((-1,) + v.shape[2:]) for k, v in batch.items()}


def _gae(rew: np.ndarray, val: np.ndarray, done: np.ndarray, last: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    adv = np.zeros_like(rew)
    running = np.zeros(rew.shape[1], np.float32)
    next_value = last
    for t in reversed(range(rew.shape[0])):
        alive = 1.0 - done[t]
        delta = rew[t] + gamma * next_value * alive - val[t]
        running = delta + gamma * lam * alive * running
        adv[t] = running
        next_value = val[t]
    return adv


def _vtrace(rew: np.ndarray, val: np.ndarray, done: np.ndarray, last: np.ndarray, log_rho: np.ndarray, gamma: float,
            lam: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """V-trace for a rollout of another policy: the policy-gradient advantages, the value targets and the
    importance weights ``exp(log_rho)`` (this policy over the sampling one) truncated at 1, which also cut
    the traces (scaled by ``lam``). The policy gradient weighs each advantage by its weight. On its own
    policy (``log_rho`` 0) the targets are GAE's returns and every weight is 1."""
    rho = np.minimum(1.0, np.exp(log_rho)).astype(np.float32)
    trace = lam * rho
    ahead = np.zeros_like(rew)  # v_s - V(x_s)
    running = np.zeros(rew.shape[1], np.float32)
    next_value = last
    for t in reversed(range(rew.shape[0])):
        alive = 1.0 - done[t]
        running = rho[t] * (rew[t] + gamma * next_value * alive - val[t]) + gamma * trace[t] * alive * running
        ahead[t] = running
        next_value = val[t]
    target = ahead + val
    following = np.concatenate([target[1:], last[None]]).astype(np.float32)
    return rew + gamma * following * (1.0 - done) - val, target, rho
