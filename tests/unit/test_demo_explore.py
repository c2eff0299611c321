"""The demo's tasks and explored hyper-parameters, without processes: options checked with a ConfigError
naming the option, each rank's starting values drawn in range and seeded, the explore step within its
bounds, the explored values saved and restored with an agent, and returns.png's marks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from popmesh import ConfigError
from popmesh.demo.config import (
    ENT_RANGE,
    ENVS,
    LR_RANGE,
    DemoConfig,
    explore_hyper,
    initial_hyper,
    parse_explore,
    parse_range,
    rank_hyper,
)


def test_each_task_has_its_target_and_an_unknown_task_is_refused():
    assert DemoConfig().target == 475.0 and DemoConfig(env="Acrobot-v1").target == -100.0
    assert set(ENVS) == {"CartPole-v1", "Acrobot-v1"}
    with pytest.raises(ConfigError, match=r"--env 'Pendulum-v1': choose one of CartPole-v1, Acrobot-v1"):
        DemoConfig(env="Pendulum-v1")


@pytest.mark.parametrize(("text", "pair"), [("1e-5:1e-1", (1e-5, 1e-1)), (" 0.001 : 0.01 ", (1e-3, 1e-2))])
def test_a_range_is_low_colon_high(text, pair):
    assert parse_range("--lr-range", text) == pair


@pytest.mark.parametrize("text", ["1e-3", "a:b", "1e-2:1e-3", "0:1e-2", "-1e-3:1e-2", "1e-3:1e-3", "1e-3:inf"])
def test_a_range_that_cannot_be_drawn_log_uniformly_names_the_option_and_an_example(text):
    with pytest.raises(ConfigError, match=r"^--ent-range .*e\.g\. --ent-range 1e-4:1e-2"):
        parse_range("--ent-range", text)


def test_the_config_checks_ranges_that_came_through_json():
    config = DemoConfig(**json.loads(json.dumps(DemoConfig(lr_range=(1e-4, 1e-2)).to_dict())))
    assert config.lr_range == (1e-4, 1e-2) and config.explore == ("lr", "ent_coef")
    with pytest.raises(ConfigError, match=r"^--lr-range 0.1:0.01: give 0 < LOW < HIGH"):
        DemoConfig(lr_range=(1e-1, 1e-2))


def test_explore_names_what_the_model_carries():
    assert parse_explore("lr, ent_coef") == ("lr", "ent_coef") and parse_explore("") == ()
    assert DemoConfig(explore=("ent_coef",)).explore == ("ent_coef",)
    assert DemoConfig(explore=()).explore == ()  # --no-explore
    for names in (("lr", "gamma"), ("lr", "lr")):
        with pytest.raises(ConfigError, match=r"--explore .*: name each of lr, ent_coef at most once.*--no-explore"):
            DemoConfig(explore=names)


def test_each_rank_draws_its_starting_values_in_range_seeded_by_seed_and_rank():
    drawn = [initial_hyper(0, rank) for rank in range(64)]
    assert drawn == [initial_hyper(0, rank) for rank in range(64)]
    assert drawn != [initial_hyper(1, rank) for rank in range(64)]
    lrs, ents = np.array([d["lr"] for d in drawn]), np.array([d["ent_coef"] for d in drawn])
    assert ((LR_RANGE[0] <= lrs) & (lrs <= LR_RANGE[1])).all()
    assert ((ENT_RANGE[0] <= ents) & (ents <= ENT_RANGE[1])).all()
    assert len(set(lrs)) == 64 and len(set(ents)) == 64
    middle = np.log(LR_RANGE).mean()  # log-uniform: about as many below the range's log-midpoint as above
    assert 16 <= (np.log(lrs) < middle).sum() <= 48
    narrow = initial_hyper(0, 3, lr_range=(1e-3, 2e-3), ent_range=(1e-2, 2e-2))
    assert 1e-3 <= narrow["lr"] <= 2e-3 and 1e-2 <= narrow["ent_coef"] <= 2e-2
    hyper = rank_hyper(0, 3)
    assert (hyper.lr, hyper.entropy) == (drawn[3]["lr"], drawn[3]["ent_coef"])


def test_the_explore_step_moves_only_the_names_given_within_their_ranges_reproducibly():
    space = DemoConfig().declarations()
    start = {"lr": 1e-3, "ent_coef": 1e-2}
    moved = [explore_hyper(start, ("lr", "ent_coef"), space, 0, r, i) for r in range(4) for i in range(25)]
    assert moved == [explore_hyper(start, ("lr", "ent_coef"), space, 0, r, i) for r in range(4) for i in range(25)]
    for name, (low, high) in (("lr", LR_RANGE), ("ent_coef", ENT_RANGE)):
        values = [m[name] for m in moved]
        assert all(low <= v <= high for v in values)
        perturbed = [v for v in values if min(abs(v - 0.8 * start[name]), abs(v - 1.2 * start[name])) < 1e-12]
        assert 0.6 * len(values) <= len(perturbed) < len(values)  # 0.8x or 1.2x, else (p = 0.25) resampled
    only = explore_hyper(start, ("ent_coef",), space, 0, 0, 0)
    assert only["lr"] == 1e-3 and only["ent_coef"] != 1e-2
    # a value inherited a hair outside the range (a float32 buffer's round trip) is taken back inside it
    edge = explore_hyper({"lr": LR_RANGE[1] * (1 + 1e-7), "ent_coef": 1e-2}, ("lr",), space, 0, 0, 0)
    assert LR_RANGE[0] <= edge["lr"] <= LR_RANGE[1]


def test_a_baseline_of_another_task_is_refused(tmp_path):
    (tmp_path / "history.jsonl").write_text("")
    (tmp_path / "summary.json").write_text(json.dumps({"config": {"env": "Acrobot-v1"}}))
    DemoConfig(env="Acrobot-v1", baseline=str(tmp_path))
    with pytest.raises(ConfigError, match=r"trained on Acrobot-v1, this one on CartPole-v1: .*--env Acrobot-v1"):
        DemoConfig(baseline=str(tmp_path))


def test_an_agent_saves_and_restores_its_explored_values(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    from popmesh.demo.learner import PPOLearner

    learner = PPOLearner(1, rank_hyper(0, 1), init_seed=0, env="Acrobot-v1")
    learner.set_hyper(lr=3e-3, ent_coef=2e-2)
    learner.iterate()  # 64 steps of 8 Acrobot episodes that last up to 500: none has finished
    assert np.isnan(learner.mean_return()) and learner.score() == -64.0  # the population compares a finite return
    agent = learner.checkpoint(1)
    other = PPOLearner(2, rank_hyper(0, 2), init_seed=0, env="Acrobot-v1")
    assert other.restore(agent) == 1
    assert other.explored() == pytest.approx({"lr": 3e-3, "ent_coef": 2e-2}, rel=1e-6)
    assert other.hyper.entropy == pytest.approx(2e-2, rel=1e-6)
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3, rel=1e-6)
    cartpole = PPOLearner(2, rank_hyper(0, 2), init_seed=0)
    with pytest.raises(ConfigError, match=r"trained on Acrobot-v1, this run on CartPole-v1: give --env Acrobot-v1"):
        cartpole.restore(agent)
    for each in (learner, other, cartpole):
        each.close()


def _history():
    """Two ranks over 10 iterations; rank 1 is replaced at iterations 4 (values explored) and 8 (kept)."""
    rows = []
    for rank in (0, 1):
        for i in range(10):
            lr = 1e-3 * (rank + 1) * (1.2 if rank == 1 and i >= 4 else 1.0)
            rows.append({"rank": rank, "iteration": i, "steps": 512 * (i + 1), "time": float(i),
                         "mean_return": None if i == 0 else -500.0 + 40 * i + 20 * rank, "lr": lr, "ent_coef": 1e-2})
    events = [{"rank": 1, "iteration": 4, "steps": 2560, "donors": [0], "weights": [1.0], "metric_before": -320.0,
               "lr_inherited": 1e-3, "lr": 1.2e-3, "ent_coef_inherited": 1e-2, "ent_coef": 8e-3,
               "explored": ["lr", "ent_coef"]},
              {"rank": 1, "iteration": 8, "steps": 4608, "donors": [0], "weights": [1.0], "metric_before": None,
               "lr_inherited": 1e-3, "lr": 1e-3, "explored": []}]
    return rows, events


def test_returns_png_marks_exploits_and_explores(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from popmesh.demo.outputs import _mark_replacements, plot_returns

    rows, events = _history()
    plot_returns(tmp_path / "returns.png", rows, events, -100.0, env="Acrobot-v1")
    assert (tmp_path / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = Figure().add_subplot()
    curve = [r for r in rows if r["rank"] == 1 and r["mean_return"] is not None]
    _mark_replacements(ax, "C1", curve, events)
    marks = [(line.get_xdata()[0], line.get_ydata()[0], line.get_markerfacecolor()) for line in ax.lines]
    # filled where the explore step moved the values; hollow where it kept them, on the curve (no metric_before)
    assert marks == [(2560, -320.0, "C1"), (4608, -500.0 + 40 * 8 + 20, "white")]
    assert [t.get_text() for t in ax.texts] == ["lr↑ ent↓"]


def test_pb2_and_a_reference_agent_need_the_latest_decisions():
    from popmesh.demo.config import DemoConfig

    assert DemoConfig().library_explores and not DemoConfig(decide="complete").library_explores
    with pytest.raises(ConfigError, match="--explore-method pb2"):
        DemoConfig(explore_method="pb2", decide="complete")
    with pytest.raises(ConfigError, match="--explore-method pb2"):
        DemoConfig(explore_method="pb2", explore=())
    with pytest.raises(ConfigError, match="--reference needs"):
        DemoConfig(reference=True, ranks=2)
    with pytest.raises(ConfigError, match="choose perturb"):
        DemoConfig(explore_method="bayes")
    assert DemoConfig(reference=True, explore_method="pb2").reference


def test_the_optimizer_start_of_a_replaced_agent_is_one_of_three():
    from popmesh.demo.config import OPTIMIZER_STATES, DemoConfig

    assert OPTIMIZER_STATES == ("reset", "keep", "copy") and DemoConfig().optimizer == "reset"
    with pytest.raises(ConfigError, match="--optimizer 'adam'"):
        DemoConfig(optimizer="adam")


def test_the_last_returns_travel_with_the_weights():
    """An agent whose weights were replaced takes the returns they earned (its metric, and its target),
    as a Ray Tune trial restored from its donor's checkpoint does; a fresh agent brings none."""
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    from popmesh.demo.learner import WINDOW, PPOLearner

    donor, replaced, fresh = (PPOLearner(seed, rank_hyper(0, seed), init_seed=0) for seed in (1, 2, 3))
    for _ in range(4):  # CartPole's first episodes last about 20 steps: 4 x 64 steps on 8 envs fill the window
        donor.iterate()
        replaced.iterate()
    assert len(donor.recent) == WINDOW and list(donor.recent) != list(replaced.recent)
    replaced.model.load_state_dict(donor.model.state_dict())  # what a replacement by one donor does
    replaced.adopt_returns()
    assert list(replaced.recent) == pytest.approx(list(donor.recent))
    assert replaced.score() == pytest.approx(donor.score())
    replaced.model.load_state_dict(fresh.model.state_dict())  # weights that never finished an episode
    replaced.adopt_returns()
    assert not replaced.recent and np.isnan(replaced.mean_return())
    for each in (donor, replaced, fresh):
        each.close()


def test_an_mpi_job_that_restarts_needs_a_checkpoint_to_resume_from():
    with pytest.raises(ConfigError, match=r"restarts the whole job .* add --checkpoint-every K"):
        DemoConfig(engine="mpi", max_restarts=1)
    assert DemoConfig(engine="mpi", max_restarts=1, checkpoint_every=10).max_restarts == 1


@pytest.mark.parametrize("ratio", [0.0, 0.6, -0.25])
def test_the_replaced_fraction_is_at_most_a_half(ratio):
    with pytest.raises(ConfigError, match=r"--ratio .*in \(0, 0\.5\]"):
        DemoConfig(ratio=ratio)


@pytest.mark.parametrize("last", [-1, 21])
def test_selection_looks_at_one_to_twenty_episodes(last):
    with pytest.raises(ConfigError, match=r"--select-last .* last 1 to 20 episodes"):
        DemoConfig(select_last=last)
    with pytest.raises(ConfigError, match="--select-last"):  # the hypergrid ranks its GFlowNets by L1
        DemoConfig(task="hypergrid", ranks=6, select_last=5)


def test_an_agent_can_be_ranked_by_its_last_episodes_alone():
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    from popmesh.demo.learner import PPOLearner

    learner = PPOLearner(0, rank_hyper(0, 0), init_seed=0)
    learner.recent.extend([10.0] * 15 + [100.0] * 5)  # a jump the 20-episode mean sees late
    assert learner.score() == learner.mean_return() == pytest.approx(32.5)
    assert learner.score(5) == pytest.approx(100.0) and learner.score(20) == pytest.approx(32.5)
    learner.recent.clear()
    learner.recent.extend([200.0, 300.0])  # fewer episodes than asked: all of them
    assert learner.score(5) == pytest.approx(250.0)
    learner.close()
