"""Pure parts of the launcher: rank plans, thread shares, config errors, error records, summaries."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from popmesh.core.errors import ConfigError, EngineUnavailable, PeerFailure
from popmesh.launch import cli, errorfile
from popmesh.launch.api import launch
from popmesh.launch.fork import fork, in_launched_world, parse_invocation
from popmesh.launch.info import distributed_env, format_info
from popmesh.launch.mpirun import find_mpiexec, mpi_command
from popmesh.launch.plan import LaunchSpec, base_env, plan_mpi_env, plan_ranks, thread_share, validate
from popmesh.launch.result import LaunchFailed, LaunchResult, RankFailure, exit_status, format_summary

pytestmark = pytest.mark.timeout(30)


def test_single_node_ranks_and_common_variables() -> None:
    plans = plan_ranks(LaunchSpec(nproc=3), port=29500, error_dir="/e", store_fd=7)
    assert [p.rank for p in plans] == [0, 1, 2]
    assert [p.local_rank for p in plans] == [0, 1, 2]
    for p in plans:
        assert p.env["RANK"] == str(p.rank) and p.env["LOCAL_RANK"] == str(p.local_rank)
        assert p.env["WORLD_SIZE"] == "3" and p.env["LOCAL_WORLD_SIZE"] == "3" and p.env["GROUP_RANK"] == "0"
        assert p.env["MASTER_ADDR"] == "127.0.0.1" and p.env["MASTER_PORT"] == "29500"
        assert p.env["POPMESH_ENGINE"] == "torch"
        assert p.env["POPMESH_ERROR_FILE"] == os.path.join("/e", f"rank-{p.rank}.json")
        assert not any(k.startswith("JAX_") for k in p.env)
    assert [p.env.get("POPMESH_STORE_FD") for p in plans] == ["7", None, None]


def test_torchrun_variables_of_each_rank() -> None:
    spec = LaunchSpec(nproc=2, nnodes=3, node_rank=2, master_port=5, run_id="job7", role="trainer")
    for p in plan_ranks(spec, port=5, error_dir="/e"):
        assert {k: v for k, v in p.env.items() if k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_"))} == {
            "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "3", "ROLE_NAME": "trainer", "ROLE_RANK": str(p.rank),
            "ROLE_WORLD_SIZE": "6", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": p.env["POPMESH_ERROR_FILE"],
        }
    assert [p.rank for p in plan_ranks(spec, port=5, error_dir="/e")] == [4, 5]
    assert not any(k.startswith("TORCHELASTIC_") for k in plan_mpi_env(LaunchSpec(nproc=2, engine="mpi"), "/e"))


def test_with_restarts_the_launcher_serves_the_store_and_rank_zero_gets_no_socket() -> None:
    spec = LaunchSpec(nproc=2, max_restarts=3)
    plans = plan_ranks(spec, port=5, error_dir="/e", store_fd=7)
    assert {p.env["TORCHELASTIC_USE_AGENT_STORE"] for p in plans} == {"True"}
    assert {p.env["TORCHELASTIC_MAX_RESTARTS"] for p in plans} == {"3"}
    assert all("POPMESH_STORE_FD" not in p.env for p in plans)


def test_multi_node_numbering_and_store_only_on_node_zero() -> None:
    spec = LaunchSpec(nproc=3, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=4000)
    plans = plan_ranks(spec, port=4000, error_dir="/e", store_fd=9)
    assert [p.rank for p in plans] == [3, 4, 5]
    assert {p.env["WORLD_SIZE"] for p in plans} == {"6"}
    assert {p.env["GROUP_RANK"] for p in plans} == {"1"}
    assert {p.env["MASTER_ADDR"] for p in plans} == {"10.0.0.1"}
    assert all("POPMESH_STORE_FD" not in p.env for p in plans)
    assert not spec.hosts_store and LaunchSpec(nproc=1).hosts_store


def test_jax_engine_variables() -> None:
    plans = plan_ranks(LaunchSpec(nproc=2, engine="jax", master_addr="h"), port=1234, error_dir="/e", store_fd=5)
    for p in plans:
        assert p.env["POPMESH_ENGINE"] == "jax"
        assert p.env["JAX_COORDINATOR_ADDRESS"] == "h:1234"
        assert p.env["JAX_NUM_PROCESSES"] == "2" and p.env["JAX_PROCESS_ID"] == str(p.rank)
        assert "POPMESH_STORE_FD" not in p.env


def test_mpi_env_uses_a_rank_placeholder() -> None:
    env = plan_mpi_env(LaunchSpec(nproc=4, engine="mpi"), "/e")
    assert env == {"POPMESH_ENGINE": "mpi", "POPMESH_ERROR_FILE": os.path.join("/e", "rank-{rank}.json")}
    with pytest.raises(ConfigError, match="plan_mpi_env"):
        plan_ranks(LaunchSpec(nproc=2, engine="mpi"), port=1, error_dir="/e")


@given(cpus=st.integers(1, 512), lws=st.integers(1, 512))
def test_thread_share_divides_the_cores(cpus: int, lws: int) -> None:
    share = thread_share(cpus, lws)
    assert share >= 1
    assert share == max(1, cpus // lws)
    assert share * lws <= max(cpus, lws)


def test_base_env_strips_an_enclosing_world_and_respects_user_threads() -> None:
    parent = {
        "PATH": "/bin", "RANK": "3", "PMI_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "JAX_PROCESS_ID": "1",
        "POPMESH_STORE_FD": "4", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "7",
        "POPMESH_ENGINE": "mpi", "POPMESH_TIMEOUT": "9", "JAX_PLATFORMS": "cpu",
    }
    env = base_env(parent, LaunchSpec(nproc=4), cpus=16)
    assert env == {
        "PATH": "/bin", "OMP_NUM_THREADS": "7", "MKL_NUM_THREADS": "4", "POPMESH_ENGINE": "torch",
        "POPMESH_TIMEOUT": "9", "JAX_PLATFORMS": "cpu", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    mine = base_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "ROLE_NAME": "x", "GROUP_WORLD_SIZE": "2"},
                    LaunchSpec(nproc=1), cpus=1)
    assert mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "ROLE_NAME" not in mine and "GROUP_WORLD_SIZE" not in mine
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in base_env({}, LaunchSpec(nproc=1, engine="mpi"), cpus=1)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (LaunchSpec(nproc=0), "-n 1 or more"),
        (LaunchSpec(nproc=2, engine="horovod"), "unknown engine"),
        (LaunchSpec(nproc=2, nnodes=0), "at least one node"),
        (LaunchSpec(nproc=2, nnodes=2, node_rank=2, master_port=5), "outside 0..1"),
        (LaunchSpec(nproc=2, node_rank=-1), "outside 0..0"),
        (LaunchSpec(nproc=2, master_port=70000), "not a TCP port"),
        (LaunchSpec(nproc=2, master_addr=""), "master-addr"),
        (LaunchSpec(nproc=2, nnodes=2), "same --master-port"),
        (LaunchSpec(nproc=2, nnodes=2, engine="mpi", master_port=5), "mpiexec"),
        (LaunchSpec(nproc=2, max_restarts=1, engine="jax"), r"jax\.distributed cannot take"),
        (LaunchSpec(nproc=2, max_restarts=-1), "give 0"),
        (LaunchSpec(nproc=2, role=""), "--role is empty"),
        (LaunchSpec(nproc=2, run_id=""), "--rdzv-id is empty"),
    ],
)
def test_bad_specs_say_what_to_do(spec: LaunchSpec, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        validate(spec)


def test_launch_rejects_bad_targets_before_starting_anything(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        launch(str(tmp_path / "missing.py"), nproc=2)
    with pytest.raises(ConfigError, match="module name"):
        launch("not a module", module=True)
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="grace"):
        launch(str(script), grace=-1)
    with pytest.raises(ConfigError, match="unknown engine"):
        launch(str(script), engine="tpu")


def test_missing_mpiexec_names_the_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EngineUnavailable, match="pip install mpi4py mpich"):
        find_mpiexec(str(tmp_path / "python"))
    assert mpi_command("mpx", 3, ["py", "w.py"], hydra=True) == [
        "mpx", "-n", "3", "-prepend-pattern", "[rank %r] ", "py", "w.py"
    ]
    assert mpi_command("mpx", 2, ["py"], hydra=False) == ["mpx", "-n", "2", "py"]


def test_error_record_round_trip(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PMI_RANK", "4")
    monkeypatch.delenv("RANK", raising=False)
    template = str(tmp_path / "rank-{rank}.json")
    path = errorfile.error_file_path(template)
    assert path == str(tmp_path / "rank-4.json")
    try:
        raise KeyError("lost")
    except KeyError as exc:
        record = errorfile.make_record(exc)
    errorfile.write_error_file(record, path)
    back = errorfile.read_error_file(path)
    assert back == record
    assert back.rank == 4 and back.type == "KeyError" and "lost" in back.message
    assert "test_error_record_round_trip" in back.traceback
    (tmp_path / "bad.json").write_text("{not json")
    assert errorfile.read_error_file(str(tmp_path / "bad.json")) is None
    assert errorfile.read_error_file(str(tmp_path / "none.json")) is None


def test_a_record_names_the_peers_an_exact_peer_failure_in_its_chain_blamed(tmp_path) -> None:
    try:
        try:
            raise PeerFailure("rank 1 died", [1])
        except PeerFailure as lost:
            raise RuntimeError("the save failed") from lost
    except RuntimeError as exc:
        record = errorfile.make_record(exc)
    assert record.peers == (1,)
    path = str(tmp_path / "r.json")
    errorfile.write_error_file(record, path)
    assert errorfile.read_error_file(path) == record
    assert errorfile.make_record(PeerFailure("one of 1, 2", [1, 2], exact=False)).peers == ()
    assert errorfile.make_record(ValueError("x")).peers == ()


def test_a_rank_killed_outright_is_the_root_cause_though_its_peer_recorded_the_loss_before_it_was_reaped(
        tmp_path) -> None:
    """Rank 1 is SIGKILLed; rank 0 records the PeerFailure at 100.0 and is then torn down by the launcher,
    which reaped rank 1 only at 100.5 (a loaded machine): rank 1 is the root cause, with its own code."""
    from popmesh.launch.output import OutputPump
    from popmesh.launch.runner import Child
    from popmesh.launch.verdict import judge_local

    record = errorfile.ErrorRecord(0, "popmesh.core.errors.PeerFailure", "rank 1 died", "", 100.0, 10, "h", (1,))
    errorfile.write_error_file(record, str(tmp_path / "rank-0.json"))
    children = [Child(0, None, returncode=-15, exited_at=100.6, signalled=True),  # type: ignore[arg-type]
                Child(1, None, returncode=-9, exited_at=100.5)]  # type: ignore[arg-type]
    result = judge_local(children, error_dir=str(tmp_path), pump=OutputPump(sys.stdout, sys.stderr),
                         teardown_at=100.5, received=None, world_size=2, engine="torch")
    assert result.returncode == 137 and result.failure is not None and result.failure.rank == 1
    assert [f.rank for f in result.other_failures] == [0]


def test_exit_status_and_summary() -> None:
    assert exit_status(0) == (0, None) and exit_status(3) == (3, None)
    assert exit_status(-9) == (137, "SIGKILL") and exit_status(-15) == (143, "SIGTERM")
    record = errorfile.ErrorRecord(2, "ValueError", "bad x", "Traceback...\nValueError: bad x\n", 1.0, 11, "h")
    failure = RankFailure(2, 1, None, record, ("ignored",))
    result = LaunchResult(1, 4, "torch", failure, (RankFailure(3, 137, "SIGKILL"),), terminated=(0, 1))
    text = format_summary(result)
    assert "root cause: rank 2 exited with code 1 after raising ValueError: bad x" in text
    assert "    ValueError: bad x" in text and "ignored" not in text
    assert "also failed: rank 3 was killed by SIGKILL (exit code 137)" in text
    assert "terminated by the launcher: ranks 0, 1" in text
    with pytest.raises(LaunchFailed) as info:
        result.check()
    assert isinstance(info.value, PeerFailure) and info.value.ranks == (2, 3) and info.value.result is result
    ok = LaunchResult(0, 4, "torch")
    assert ok.ok and ok.check() is ok
    tail_only = format_summary(LaunchResult(137, 2, "torch", RankFailure(1, 137, "SIGKILL", None, ("last words",))))
    assert "last lines of its stderr:\n    last words" in tail_only


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["py", "train.py", "--lr", "3"], ((), "train.py", False, ("--lr", "3"))),
        (["py", "-u", "-X", "dev", "-W", "ignore", "t.py"], (("-u", "-X", "dev", "-W", "ignore"), "t.py", False, ())),
        (["py", "-m", "pkg.mod", "-m", "x"], ((), "pkg.mod", True, ("-m", "x"))),
        (["py", "-B", "-mpkg", "a"], (("-B",), "pkg", True, ("a",))),
        (["py", "--", "-odd.py", "a"], ((), "-odd.py", False, ("a",))),
    ],
)
def test_parse_invocation(argv: list[str], expected: tuple) -> None:
    got = parse_invocation(argv)
    assert (got.interpreter_options, got.target, got.module, got.args) == expected


@pytest.mark.parametrize("argv", [["py", "-c", "x"], ["py", "-"], ["py", "-u"]])
def test_parse_invocation_refuses_what_cannot_be_relaunched(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_invocation(argv)


def test_in_launched_world_and_trivial_forks(monkeypatch) -> None:
    for name in ("POPMESH_ENGINE", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not in_launched_world({"MASTER_ADDR": "x"})
    assert in_launched_world({"POPMESH_ENGINE": "torch"}) and in_launched_world({"PMI_RANK": "0"})
    assert fork(1) is False
    with pytest.raises(ConfigError):
        fork(0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.warns(UserWarning, match="world of 3"):
        assert fork(2) is False


def test_info_formatting() -> None:
    env = distributed_env({"RANK": "1", "PMI_SIZE": "2", "HOME": "/root", "JAX_PROCESS_ID": "0"})
    assert env == {"JAX_PROCESS_ID": "0", "PMI_SIZE": "2", "RANK": "1"}
    info = {
        "platform": "p", "python_executable": "py", "versions": {"python": "3", "torch": None},
        "engines": {"torch": False, "mpi": True}, "cpu_count": 2, "environment": env,
    }
    text = format_info(info)
    assert "- torch version: not installed" in text and "mpi (yes)" in text and "    RANK=1" in text
    assert "- MPI C path: no mpi4py" in text
    assert json.loads(format_info(info, as_json=True)) == info
    info["mpi_c_path"] = {"state": "refused", "reason": "it is built for the MPICH wheel, and this MPI is 'Open MPI'"}
    assert "- MPI C path: refused (it is built for the MPICH wheel, and this MPI is 'Open MPI')" in format_info(info)


def test_cli_registry_accepts_new_commands(capsys) -> None:
    seen: list[argparse.Namespace] = []
    hello = cli.Command(
        "hello", "say hello", lambda p: p.add_argument("--x", type=int), lambda ns: seen.append(ns) or 5
    )
    cli.register_command(hello)
    try:
        assert {"launch", "info", "hello"} <= set(cli.commands())
        assert cli.main(["hello", "--x", "3"]) == 5 and seen[0].x == 3
        assert cli.main(["launch", "-n", "0", "whatever.py"]) == 2
        assert "-n 1 or more" in capsys.readouterr().err
        ns = cli.build_parser().parse_args(["launch", "-n", "2", "-m", "pkg.mod", "--lr", "3", "-n", "9"])
        assert (ns.nproc, ns.module, ns.target, ns.args) == (2, True, "pkg.mod", ["--lr", "3", "-n", "9"])
    finally:
        cli._COMMANDS.pop("hello")


def test_importing_the_launcher_imports_no_engine() -> None:
    code = (
        "import sys, popmesh.launch, popmesh.launch.cli;"
        "bad = [m for m in ('torch', 'mpi4py', 'jax') if m in sys.modules];"
        "sys.exit(str(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)

