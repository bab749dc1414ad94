"""Hangs: the watchdog ends a stuck rank, the grace timer runs while the main thread is stuck in
C++, the ledger counts the stall, and hang drills through the real entry point resume exactly."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers import REPO, run_train

from goodput.resilience.fault import FaultConfig
from goodput.resilience.watchdog import HUNG_EXIT, hung_seconds

# each test times a hang, a grace period or a collective timeout against the wall clock
pytestmark = pytest.mark.serial

# The main thread blocked in C with the GIL released, deaf to signals (a mutex it already holds:
# pthread_mutex_lock is never interrupted), as in a gloo collective whose peer hung: a Python
# handler would wait for it forever.
STUCK = """
import ctypes
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # zeros: PTHREAD_MUTEX_INITIALIZER on glibc
libc.pthread_mutex_lock(mutex)
libc.pthread_mutex_lock(mutex)
print("returned", flush=True)
"""

WATCHDOG = (
    """
import logging, sys
logging.basicConfig(level=logging.INFO)
from goodput.resilience.watchdog import Watchdog
w = Watchdog(timeout_s=1.0, first_timeout_s=1.0, rank=3).start()
w.beat(7)
w.doing("checkpoint save of step 8")
"""
    + STUCK
)


def test_watchdog_ends_a_rank_stuck_in_cpp_naming_rank_step_and_stack():
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", WATCHDOG], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == HUNG_EXIT, p.stderr[-3000:]
    assert "rank 3 made no progress" in p.stderr and "last step done: 7" in p.stderr
    assert "doing: checkpoint save of step 8" in p.stderr
    assert "Current thread" in p.stderr or "Thread 0x" in p.stderr  # faulthandler's dump
    assert took < 30, took  # 1 s, not never


GRACE = (
    """
import os, signal, threading, time
from goodput.resilience.preemption import StopSignal
stop = StopSignal(grace_s=1.0)
def notice():
    time.sleep(1.0)  # the main thread is stuck by then
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=notice, daemon=True).start()
"""
    + STUCK
)


def test_preemption_grace_runs_while_the_main_thread_is_stuck_in_cpp():
    """The Python handler never runs here (the main thread does not return to the interpreter),
    so only a timer that does not need it can end the process within the grace period."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", GRACE], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 128 + 15, p.stderr[-3000:]
    assert took < 30, took  # grace 1 s (plus imports), not never
    assert "returned" not in p.stdout


def test_hung_seconds_counts_stalls_after_the_restored_save_once_per_attempt():
    markers = {
        "hung-attempt0-rank0.fired": {"attempt": 0, "detected": 100.0, "hung_seconds": 3.1},
        "hung-attempt0-rank1.fired": {"attempt": 0, "detected": 100.1, "hung_seconds": 3.3},
        "hung-attempt1-rank1.fired": {"attempt": 1, "detected": 200.0, "hung_seconds": 2.0},
        "kill_at_step-5.fired": {"time": 150.0},
    }
    assert hung_seconds(markers, since=0.0) == pytest.approx(5.3)
    assert hung_seconds(markers, since=150.0) == pytest.approx(2.0)  # the restored save is newer


def test_hang_site_is_checked():
    with pytest.raises(ValueError, match="fault.hang_site"):
        FaultConfig(hang_site="gpu")


# -- drills through the real entry point: 2-rank DDP under the elastic agent ----------------------
HANG_TIMEOUT = 3


def hang_drill(tmp_path, site: str, *extra: str) -> dict:
    _, s = run_train(
        tmp_path, "parallel=ddp", "checkpoint=dcp_sync", "parallel.max_restarts=1",
        f"trainer.hang_timeout_s={HANG_TIMEOUT}", "fault.hang_at_step=6", "fault.hang_rank=1",
        f"fault.hang_site={site}", *extra, timeout=400,
    )  # fmt: skip
    return s


@pytest.mark.slow
@pytest.mark.parametrize("site", ["collective"])  # the other sites: docs/hangs.md, by hand
def test_hang_drill_restarts_within_the_timeout_and_resumes_exactly(tmp_path, smoke_reference, site):
    ref = smoke_reference("dcp_sync", "parallel=ddp")
    s = hang_drill(tmp_path, site)
    # the hung rank's watchdog rescues the step it finished before hanging (checkpointing.md)
    assert s["restarts"] == 1 and s["resumed_from_steps"] == [6]
    assert s["model_sha256"] == ref["model_sha256"]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]
    rec = s["recovery"]["per_restart"][0]
    assert rec["failure_source"] == "fault_marker"  # measured from the hang's start
    assert rec["total_seconds"] <= HANG_TIMEOUT + 3, rec
    assert HANG_TIMEOUT * 0.9 <= s["goodput"]["hung_seconds"] <= HANG_TIMEOUT + 2


def test_drill_script_knows_hangs():
    out = subprocess.run(
        [sys.executable, "scripts/drill.py", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "--hang" in out
    assert "rescue" in out and "rescue60" in out  # the presets of docs/benchmarks.md's rescue tables


def test_commit_timeout_must_fit_the_time_interval():
    from goodput.checkpoint import CheckpointConfig

    node = {"_target_": "goodput.checkpoint.backends.DCPSync"}
    with pytest.raises(ValueError, match="commit_timeout_s=600 must be shorter"):
        CheckpointConfig(node, "/tmp/x", "/tmp/y", None, 5.0, commit_timeout_s=600.0)
    CheckpointConfig(node, "/tmp/x", "/tmp/y", None, 5.0, commit_timeout_s=120.0)


PEER_GONE = """
import os, sys, time, torch, torch.distributed as dist
rank, mesh = int(sys.argv[1]), sys.argv[3] == "mesh"
world = 4 if mesh else 2
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
from goodput.parallel import HSDP, init_distributed, set_collective_timeout
d = init_distributed(timeout_s=60)
strategy = HSDP(shard_size=2)
# hsdp's collectives run on the 2 x 2 mesh's groups, made by init_device_mesh: rank 0's shard group is [0, 1]
group = strategy.device_mesh(d).get_group("shard") if mesh else None
dist.all_reduce(torch.ones(1), group=group)  # the first step: every rank there
set_collective_timeout(1.0, strategy.collective_groups())
if rank > 0:
    time.sleep(30)  # a hung peer (and, with the mesh, two bystanders)
    sys.exit(0)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=group)
    print("completed", flush=True)
except Exception as e:
    print(f"failed after {time.monotonic() - t0:.1f}s: {type(e).__name__}", flush=True)
"""


@pytest.mark.parametrize("group", ["default", "mesh"])
def test_collectives_after_the_first_step_fail_within_the_collective_timeout(group):
    """On the default group, and on the device mesh's groups hsdp trains on (made by
    init_device_mesh with gloo's 30 min default, unless set_collective_timeout reaches them)."""
    from goodput.parallel import free_port

    port = str(free_port())
    cmd = [sys.executable, "-c", PEER_GONE]
    ranks = range(4 if group == "mesh" else 2)
    procs = [subprocess.Popen([*cmd, str(r), port, group], stdout=subprocess.PIPE, text=True) for r in ranks]
    try:
        out, _ = procs[0].communicate(timeout=25)  # the init timeout (60 s) would not fit
    finally:
        for p in procs:
            p.kill()
    assert "failed after" in out, out
    assert float(out.split("failed after ")[1].split("s")[0]) < 5.0, out


class Hung(Exception):
    pass


def test_random_hangs_are_seeded_per_attempt_and_stop_at_max_hangs(tmp_path, monkeypatch):
    """fault.hang_mtbf_seconds: each attempt of the hang rank draws its hang time from (seed,
    attempt), hangs once it is due, and no attempt hangs after max_hangs markers."""
    import goodput.resilience.fault as fault
    from goodput.storage.remote import Storage

    def raise_hung():
        raise Hung

    monkeypatch.setattr(fault, "hang_forever", raise_hung)
    store = Storage(str(tmp_path))
    clock = [1000.0]
    monkeypatch.setattr(fault.time, "monotonic", lambda: clock[0])

    def attempt(n: int, rank: int = 1) -> fault.Faults:
        f = fault.Faults(store, rank)
        f.arm_hang(None, "step", 1, mtbf_seconds=60.0, max_hangs=2)
        f.arm_random(None, 0, seed=3, attempt=n)
        return f

    a0, again = attempt(0), attempt(0)
    assert a0._hang_at_time is not None and a0._hang_at_time == again._hang_at_time  # seeded
    assert attempt(1)._hang_at_time != a0._hang_at_time  # a new draw per attempt
    assert attempt(0, rank=0)._hang_at_time is None  # only fault.hang_rank hangs
    clock[0] = a0._hang_at_time - 0.01
    a0.at_step(5)  # not due yet: returns
    clock[0] = a0._hang_at_time
    with pytest.raises(Hung):
        a0.at_step(6)
    assert (tmp_path / "faults" / "hang-random-attempt0-step.fired").exists()
    a1 = attempt(1)
    clock[0] = a1._hang_at_time
    with pytest.raises(Hung):
        a1.at_step(7)
    assert attempt(2)._hang_at_time is None  # two hangs fired: max_hangs reached
    with pytest.raises(ValueError, match="hang_mtbf_seconds"):
        FaultConfig(hang_mtbf_seconds=10.0, hang_site="dataloader")
