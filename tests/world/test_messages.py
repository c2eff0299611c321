"""Point-to-point messages on real worlds: local (1 rank), torch/gloo and MPI at 2 and 3 ranks (worlds
shared with the other communication files: suite "comm")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_world
from workers import messages_worker as worker
from worldlib import checks_of
from worldtests import world_tests

world_run, test_check, test_world_exits_cleanly = world_tests(
    worker, [("local", 1), ("torch", 2), ("torch", 3), ("mpi", 2), ("mpi", 3)], timeout=240, suite="comm"
)
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [3, 3, 3, 2])
def test_gloo_goodbyes_end_pumps_and_exits_are_clean(size):
    """Repeated because a pump left waiting at exit aborts only some of the time."""
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(size), "--engine", "torch",
           str(SCRIPTS / "p2p_goodbye.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(f"[rank {r}] rank {r} OK" in done.stdout for r in range(size - 1)), done.stdout[-3000:]
    early = next(line for line in done.stdout.splitlines() if "EARLY finalized" in line)
    assert float(early.split()[-2]) < 1.5, early  # the live peers answered its goodbye at once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
@pytest.mark.parametrize("nbytes", [1 << 10, 1 << 20, 64 << 20])
def test_fresh_ring_exchange_waiting_on_the_send_first(engine, nbytes):
    """The first traffic of a fresh world: nothing has started a receive yet when the sends are waited on."""
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "3", "--engine", engine,
           str(SCRIPTS / "p2p_fresh_ring.py"), str(nbytes)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env={**os.environ, "POPMESH_TIMEOUT": "30"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(f"rank {r} ring OK" in done.stdout for r in range(3)), done.stdout[-3000:]
    assert all(f"rank {r} threads OK" in done.stdout for r in range(3)), done.stdout[-3000:]


@pytest.mark.timeout(300)
def test_gloo_any_source_pump_keeps_every_message_promise():
    """Every message check on a world whose ranks receive on one any-source pump (as worlds wider
    than PEER_PUMPS_MAX peers do), forced here at 3 ranks."""
    run = run_world(Path(worker.__file__), "torch", 3, timeout=240, env={"POPMESH_GLOO_PEER_PUMPS": "0"})
    assert not run.timed_out, run.output[-4000:]
    for name in checks_of(worker):
        verdict, why = run.verdict(name)
        assert verdict in ("pass", "skip"), f"{name}: {why}\n{run.output[-3000:]}"
    assert run.returncodes == [0, 0, 0], run.output[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_a_flooded_receiver_holds_bounded_bytes_and_loses_nothing(engine):
    """48 MiB sent to a rank that receives nothing for 5 s: it holds at most its cap (gloo: 4 MiB
    here; MPI: the sender keeps at most its 4 MiB window in flight), a blocking send past the bound times
    out naming it, and then every frame arrives intact and in order; the per-tag tables shrink back.
    On gloo the heartbeat limit is 2 s: the held-back sender's beats wait behind its flood, and it
    must not be taken for dead."""
    env = {**os.environ, "POPMESH_TIMEOUT": "60", "POPMESH_P2P_BUFFER_BYTES": str(4 << 20)}
    if engine == "torch":
        env["POPMESH_HEARTBEAT_TIMEOUT"] = "2"
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", "2", "--engine", engine,
           str(SCRIPTS / "p2p_flood.py"), "192"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "extra send timed out naming rank 1 OK" in done.stdout, done.stdout[-3000:]
    assert "received all 193 frames intact and in order OK" in done.stdout, done.stdout[-3000:]
    assert all(f"rank {r} flood OK" in done.stdout for r in range(2)), done.stdout[-3000:]


# MPICH over OFI's shared-memory provider as if every rank were on another host: eager messages are
# buffered at the receiver, as on a cluster's fabric (without flow control, 10,000 unreceived 1 KiB
# messages grew the receiver by 360 MiB here; MPICH's own shared memory keeps them at the sender).
OFI_FABRIC = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "shm"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fabric, size", [("shm", 2), ("shm", 3), ("ofi", 2)])
def test_mpi_senders_keep_a_window_in_flight_and_lose_nothing(fabric, size):
    """5,000 messages to a rank that polls another tag for 4 s: at most a window in flight, its RSS
    bounded, a blocking send past the window times out naming it; then every message arrives in
    order, and isends past the window to a ring neighbour complete while the ranks receive."""
    env = {**os.environ, "POPMESH_TIMEOUT": "60", "POPMESH_HEARTBEAT_TIMEOUT": "2",
           **(OFI_FABRIC if fabric == "ofi" else {})}
    cmd = [sys.executable, "-m", "popmesh", "launch", "-n", str(size), "--engine", "mpi",
           str(SCRIPTS / "p2p_window.py"), "5000"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "send past the window timed out naming rank 1 OK" in done.stdout, done.stdout[-3000:]
    assert "received all 5001 messages intact and in order OK" in done.stdout, done.stdout[-3000:]
    assert all(f"rank {r} window OK" in done.stdout for r in range(size)), done.stdout[-3000:]
