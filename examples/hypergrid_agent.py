"""One hypergrid GFlowNet agent: the grid with its exact L1, a trajectory-balance GFlowNet, its optimizer,
the learning rate drawn per seed and rank, and one training step.

``examples/gfn_hypergrid.py`` trains one :class:`Agent` per trainer rank; the Ray Tune trainable of
``benchmarks/_ray_gfn.py`` trains one per trial, so that both sides drive the same learner: the same
environment, estimators, loss, batch, optimizer and param groups, initial weights (seeded by the seed
alone), learning rate and sampling seeds (per seed and rank). Importing this module needs torch and
numpy; torchgfn is imported when a grid or a GFlowNet is made.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import popmesh
from popmesh.population import Continuous, sample_hparams

__all__ = ["Grid", "Agent", "make_gflownet", "make_optimizer", "start_lr", "seed_sampling", "trajectory_arrays"]


class Grid:
    """The hypergrid and what validation needs: every cell in canonical order (torchgfn's state index),
    the target distribution reward / Z, the cells of each level (sum of coordinates) and the modes."""

    def __init__(self, ndim: int, height: int, r0: float) -> None:
        from gfn.gym import HyperGrid

        try:
            self.env = HyperGrid(ndim, height, reward_fn_kwargs={"R0": r0, "R1": 0.5, "R2": 2.0})
        except ValueError as e:  # torchgfn's check that the grid has a mode
            raise popmesh.ConfigError(f"--ndim {ndim} --height {height}: {e}; choose a larger --height") from e
        self.ndim, self.height = ndim, height
        self.powers = height ** torch.arange(ndim - 1, -1, -1)
        self.cells = (torch.arange(height ** ndim)[:, None] // self.powers) % height
        self.states = self.env.States(self.cells)
        reward = self.env.reward(self.states)
        self.target = reward / reward.sum()
        self.modes = set(torch.nonzero(self.env.mode_mask(self.states)).flatten().tolist())
        level = self.cells.sum(1)
        self.levels = [torch.nonzero(level == k).flatten() for k in range(int(level.max()) + 1)]

    def modes_in(self, cells: Any) -> set[int]:
        """The modes (cell indices) among terminal cells."""
        return self.env.modes_found(self.env.States(torch.as_tensor(cells)))

    def l1(self, gflownet: Any) -> float:
        """Exact L1 distance between the policy's terminal distribution and the target. P_T(x) is the
        probability of reaching x times that of exiting there; reaching flows from s0 level by level."""
        with torch.no_grad():
            probs = gflownet.pf.to_probability_distribution(self.states, gflownet.pf(self.states)).probs
        reach = torch.zeros(len(self.cells))
        reach[0] = 1.0
        for cells in self.levels:
            for d in range(self.ndim):
                inner = cells[self.cells[cells, d] < self.height - 1]
                reach.index_add_(0, inner + self.powers[d], reach[inner] * probs[inner, d])
        return float((reach * probs[:, -1] - self.target).abs().sum())


def make_gflownet(grid: Grid, hidden: int, seed: int) -> Any:
    """A TB GFlowNet whose initial weights depend on the seed only: the same on every trainer, so that
    averaging agents stays within one basin."""
    from gfn.estimators import DiscretePolicyEstimator
    from gfn.gflownet import TBGFlowNet
    from gfn.preprocessors import KHotPreprocessor
    from gfn.utils.modules import MLP

    torch.manual_seed(seed)
    env = grid.env
    pre = KHotPreprocessor(height=grid.height, ndim=grid.ndim)
    pf = DiscretePolicyEstimator(MLP(pre.output_dim, env.n_actions, hidden_dim=hidden, n_hidden_layers=2),
                                 env.n_actions, preprocessor=pre)
    pb = DiscretePolicyEstimator(MLP(pre.output_dim, env.n_actions - 1, hidden_dim=hidden, n_hidden_layers=2),
                                 env.n_actions, is_backward=True, preprocessor=pre)
    return TBGFlowNet(pf=pf, pb=pb, init_logZ=0.0)


def make_optimizer(gflownet: Any, lr: float, lr_z: float) -> torch.optim.Optimizer:
    """Adam: the policies' parameters first (their learning rate is what a population explores), logZ apart."""
    named = dict(gflownet.named_parameters())
    return torch.optim.Adam([{"params": [p for n, p in named.items() if n != "logZ"], "lr": lr},
                             {"params": [named["logZ"]], "lr": lr_z}])


def start_lr(lr_range: tuple[float, float], seed: int, rank: int) -> float:
    """Rank ``rank``'s initial learning rate: log-uniform over ``lr_range``, drawn from the seed and rank."""
    space = {"lr": Continuous(*lr_range, log=True)}
    return float(sample_hparams(space, np.random.default_rng([seed, rank]))["lr"])


def seed_sampling(seed: int, rank: int, generation: int = 0) -> None:
    """Seed the agent's sampling (torch) and Python's random (torchgfn's policy draws lifetimes and donors
    from it), per seed and rank; a restarted process (``generation``) samples afresh."""
    torch.manual_seed(seed * 1000 + rank + 7919 * generation)
    random.seed(seed * 1000 + rank)


def trajectory_arrays(trajectories: Any) -> dict[str, np.ndarray]:
    """Trajectories as the numpy arrays another agent rebuilds them from (``Agent.trajectories_from``), as
    ``popmesh.population.SampleSharing`` sends them: the states, the actions, where each ends, the log-rewards."""
    return {"states": trajectories.states.tensor.numpy(), "actions": trajectories.actions.tensor.numpy(),
            "terminating_idx": trajectories.terminating_idx.numpy(),
            "log_rewards": trajectories.log_rewards.detach().numpy()}


class Agent:
    """Rank ``rank``'s GFlowNet at learning rate ``lr`` (logZ at ``lr_z``), its optimizer, and its
    sampling seeded; :meth:`step` trains on ``batch_size`` fresh trajectories."""

    def __init__(self, grid: Grid, *, seed: int, rank: int, lr: float, hidden: int = 64, lr_z: float = 0.1,
                 batch_size: int = 16, generation: int = 0) -> None:
        self.grid, self.batch_size = grid, batch_size
        self.gflownet = make_gflownet(grid, hidden, seed)
        self.optimizer = make_optimizer(self.gflownet, lr, lr_z)
        seed_sampling(seed, rank, generation)

    @property
    def lr(self) -> float:
        """The policies' learning rate (param group 0)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Train the policies at ``lr`` from now on; logZ keeps its own."""
        self.optimizer.param_groups[0]["lr"] = lr

    def sample(self) -> Any:
        """``batch_size`` fresh trajectories from the forward policy, their log-probabilities kept."""
        return self.gflownet.sample_trajectories(self.grid.env, n=self.batch_size, save_logprobs=True)

    def trajectories_from(self, arrays: Mapping[str, np.ndarray]) -> Any:
        """torchgfn's ``Trajectories`` from :func:`trajectory_arrays` (another agent's, say)."""
        from gfn.containers import Trajectories

        env = self.grid.env
        return Trajectories(env, states=env.States(torch.as_tensor(arrays["states"])),
                            actions=env.Actions(torch.as_tensor(arrays["actions"])),
                            terminating_idx=torch.as_tensor(arrays["terminating_idx"]),
                            log_rewards=torch.as_tensor(arrays["log_rewards"]))

    def learn(self, trajectories: Any, shared: Sequence[Mapping[str, np.ndarray]] = ()) -> float:
        """One trajectory-balance step on ``trajectories``, and on the ``shared`` ones too (other agents', as
        :func:`trajectory_arrays`): trajectory balance holds for trajectories of any sampler with full
        support, so theirs only need their log-probabilities under this agent's policies, recomputed. The loss."""
        from gfn.containers import Trajectories

        batch = trajectories
        if shared:  # a new container: extend() grows it in place, and the sampled batch stays as it was
            batch = Trajectories(self.grid.env)
            batch.extend(trajectories)
            for arrays in shared:
                batch.extend(self.trajectories_from(arrays))
        loss = self.gflownet.loss(self.grid.env, batch, recalculate_all_logprobs=bool(shared))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def step(self) -> tuple[float, Any]:
        """One training iteration: :meth:`sample`, then :meth:`learn`; the loss and the trajectories."""
        trajectories = self.sample()
        return self.learn(trajectories), trajectories

    def l1(self) -> float:
        """The exact L1 distance of this agent's terminal distribution to the target."""
        return self.grid.l1(self.gflownet)
