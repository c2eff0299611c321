"""``popmesh demo --task hypergrid`` without processes: the options it takes, the script's command line,
and what it says when the script or torchgfn is missing."""

from pathlib import Path

import pytest

from popmesh import ConfigError
from popmesh.demo import hypergrid
from popmesh.demo.config import DemoConfig


def test_the_cartpole_task_stays_the_default():
    assert DemoConfig().task == "cartpole"
    assert DemoConfig(task="cartpole", env="Acrobot-v1", steps=1000).env == "Acrobot-v1"


def test_the_hypergrid_task_takes_the_shared_options():
    config = DemoConfig(task="hypergrid", ranks=6, seed=3, policy="none", lr_range=(1e-4, 1e-2), max_restarts=1,
                        kill="1:30")
    assert config.kill_at() == (1, 30)
    args = hypergrid.script_args(config.policy, config.seed, config.lr_range, Path("runs/x"), config.kill_at(),
                                 ["--ndim", "3"])
    assert args == ["--policy", "none", "--seed", "3", "--lr-range", "0.0001:0.01", "--out", "runs/x", "--kill-rank",
                    "1", "--kill-at", "30", "--ndim", "3"]
    assert hypergrid.script_args("async", 0, (1e-5, 0.1), Path("o"), None)[:2] == ["--policy", "selective"]
    assert hypergrid.script_args("average-all", 0, (1e-5, 0.1), Path("o"), None)[:2] == ["--policy", "average"]
    shared = DemoConfig(task="hypergrid", ranks=6, share_samples=True)  # the trainers share their trajectories
    assert hypergrid.script_args("async", 0, (1e-5, 0.1), Path("o"), None, ["--ndim", "3"],
                                 share=shared.share_samples)[-3:] == ["--share-trajectories", "--ndim", "3"]


@pytest.mark.parametrize(("options", "named"), [
    ({"env": "Acrobot-v1"}, "--env"),
    ({"steps": 1000, "every": 5}, "--steps, --every"),
    ({"explore": ()}, "--explore"),
    ({"checkpoint_every": 10}, "--checkpoint-every"),
])
def test_cartpoles_own_options_are_refused_by_name(options, named):
    with pytest.raises(ConfigError, match=f"^{named}: the CartPole task's option.*after --"):
        DemoConfig(task="hypergrid", ranks=6, **options)


def test_the_hypergrid_task_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="--policy selective: with --task hypergrid choose async"):
        DemoConfig(task="hypergrid", ranks=6, policy="selective")
    with pytest.raises(ConfigError, match="--ranks 2: --task hypergrid needs a trainer"):
        DemoConfig(task="hypergrid", ranks=2)
    with pytest.raises(ConfigError, match="--task 'grid': choose one of cartpole, hypergrid"):
        DemoConfig(task="grid")
    with pytest.raises(ConfigError, match="--policy selective: with --task hypergrid choose one of"):
        hypergrid.script_args("selective", 0, (1e-5, 0.1), Path("o"), None)


def test_a_tree_without_the_script_says_how_to_get_it(tmp_path):
    with pytest.raises(ConfigError, match=r"examples/gfn_hypergrid\.py of popmesh's source tree, not found under"):
        hypergrid.script_path(tmp_path)


def test_the_source_tree_has_the_script():
    pytest.importorskip("gfn")
    assert hypergrid.script_path().name == "gfn_hypergrid.py"


def test_the_cores_note_says_who_waits():
    assert "never waits for a trainer" in hypergrid.cores_note(6, 2)
    assert "--policy average-all waits for the slowest trainer" in hypergrid.cores_note(6, 2, "average-all")


@pytest.mark.parametrize("policy, refused", [("selective", False), ("average", False), ("none", False),
                                             ("torchgfn", True)])
def test_the_example_kills_a_trainer_under_every_policy_but_torchgfns(policy, refused):
    """``--kill-rank`` goes with every policy whose world restarts a lost rank; torchgfn's own policy runs
    on MPI, where a lost rank ends the job, so the example says which policies to use instead."""
    pytest.importorskip("torch")
    pytest.importorskip("gfn")
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import gfn_hypergrid

    ns = gfn_hypergrid.parse(["--policy", policy, "--kill-rank", "1", "--kill-at", "30"])
    world = SimpleNamespace(restarts_lost_ranks=True, engine_name="torch")
    ctx = SimpleNamespace(training_ranks=[0, 1])
    if refused:
        with pytest.raises(ConfigError, match="use --policy selective, average or none"):
            gfn_hypergrid.check(ns, world, ctx)
    else:
        gfn_hypergrid.check(ns, world, ctx)
