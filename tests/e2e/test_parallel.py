"""DDP and FSDP2 on 2 gloo ranks: smoke per checkpoint backend, elastic restart after SIGKILL,
resharding across world sizes and strategies, a two-"node" torchrun rendezvous, a -m sweep."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    FORGET_WEIGHTS,
    REPO,
    TRAIN,
    WEIGHT_RTOL,
    ckpt_dir,
    final_weights,
    latest_summary,
    run_nodes,
    run_train,
    weight_gap,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Uninterrupted 2-rank smoke runs, one per (strategy, backend), made on first use: the smoke
    tests check them, and the resume tests start from copies of them (each is a 2-rank job start)."""
    cache = {}

    def get(strategy: str, backend: str, *more: str):
        if (strategy, backend, *more) not in cache:
            root = tmp_path_factory.mktemp(f"{strategy}-{backend}")
            p, s = run_train(root, f"parallel={strategy}", f"checkpoint={backend}", *more)
            cache[strategy, backend, *more] = root, p, s
        return cache[strategy, backend, *more]

    return get


@pytest.fixture(scope="module")
def ddp_reference(two_rank_runs):
    """The uninterrupted 2-rank DDP smoke run (dcp_sync)."""
    _, p, s = two_rank_runs("ddp", "dcp_sync")
    # no fault.slow_rank: the straggler warning (tests/e2e/test_observe_runs.py) names no rank here
    assert "straggler:" not in p.stdout + p.stderr
    return s


def stopped_at_step_8(run, root: Path) -> None:
    """Make `root` what a 2-rank run leaves when it stops after its step-8 commit: a copy of the
    finished run `run` (from two_rank_runs) without the step-12 commit."""
    shutil.copytree(run[0], root, symlinks=True, dirs_exist_ok=True)
    shutil.rmtree(ckpt_dir(root) / "step-000000012")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("backend", ["torch_save", "dcp_sync", "dcp_async"])
def test_two_rank_smoke(two_rank_runs, ddp_reference, strategy, backend):
    root, _, s = two_rank_runs(strategy, backend)
    assert s["world_size"] == 2 and s["steps"] == 12
    # Same global batches, GroupNorm, gloo sums in a fixed order: the wrapper does not change the maths.
    assert s["model_sha256"] == ddp_reference["model_sha256"]
    assert s["sample_order_sha256"] == ddp_reference["sample_order_sha256"]
    step12 = ckpt_dir(root) / "step-000000012"
    commit = json.loads((step12 / "COMMIT.json").read_text())
    assert commit["world_size"] == 2 and commit["backend"] == backend
    if backend != "torch_save":  # every rank wrote its own shard
        assert {f for f in commit["files"] if f.endswith(".distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    if strategy == "fsdp" and backend == "dcp_sync":  # the export gathers the FSDP shards, exactly
        from goodput.checkpoint.export import model_state
        from goodput.checkpoint.layout import parse_commit
        from goodput.model import SmallCNN, model_sha256
        from goodput.storage.remote import Storage

        rec = parse_commit((step12 / "COMMIT.json").read_bytes(), "step-000000012")
        model = SmallCNN(num_classes=10, width=32)
        model.load_state_dict(model_state(Storage(str(step12.parent)), rec))
        assert model_sha256(model) == s["model_sha256"]


def test_elastic_restart_after_worker_sigkill(tmp_path, ddp_reference):
    p, s = run_train(
        tmp_path,
        "parallel=ddp",
        "checkpoint=dcp_sync",
        "parallel.max_restarts=2",
        "fault.kill_at_step=10",
        "fault.rank=1",
    )
    assert "SIGKILL rank 1" in p.stderr
    # rank 0 survives with step 10 whole: its rescue, not the step-8 commit (checkpointing.md)
    assert "rescue: rank 0 wrote shard 0/1 of step 10" in p.stderr
    assert s["restarts"] == 1 and s["resumed_from_steps"] == [10]
    assert s["model_sha256"] == ddp_reference["model_sha256"]
    assert s["sample_order_sha256"] == ddp_reference["sample_order_sha256"]


@pytest.mark.parametrize(
    "first, second, backend",
    [
        ("parallel=ddp", "parallel=single", "dcp_sync"),
        ("parallel=single", "parallel=ddp", "dcp_sync"),
        ("parallel=ddp", "parallel=fsdp", "dcp_sync"),
        ("parallel=fsdp", "parallel=single", "dcp_async"),
        ("parallel=ddp", "parallel=single", "torch_save"),
    ],
)
def test_resume_on_another_world_size_or_strategy(
    tmp_path, two_rank_runs, ddp_reference, first, second, backend
):
    if first == "parallel=single":  # killed at step 10 on one process: step 8 is its newest commit
        run_train(tmp_path, first, f"checkpoint={backend}", "fault.kill_at_step=10", expect_rc=None)
        over = ["fault.kill_at_step=10"]  # the marker of the kill that fired keeps it from firing again
    else:
        stopped_at_step_8(two_rank_runs(first.split("=")[1], backend), tmp_path)
        over = []
    p, s = run_train(tmp_path, second, f"checkpoint={backend}", *over)
    assert s["resumed_from_steps"] == [8]
    assert s["sample_order_sha256"] == ddp_reference["sample_order_sha256"]  # the order continued exactly
    if {first, second} == {"parallel=ddp", "parallel=fsdp"}:  # same world size, same arithmetic
        assert s["model_sha256"] == ddp_reference["model_sha256"]
    else:
        gap = weight_gap(final_weights(ckpt_dir(tmp_path)), final_weights(ddp_reference["checkpoint_dir"]))
        print(f"{first} -> {second} ({backend}): largest relative weight difference {gap:.2e}")
        assert gap < WEIGHT_RTOL, gap


# dcp_async: it passes the same planner as dcp_sync, through async_save and its stager (the
# planner itself: unit/test_checkpoint.py)
@pytest.mark.parametrize("backend", ["dcp_async"])
def test_a_ddp_resume_continues_from_rank_0s_batchnorm_statistics(tmp_path, two_rank_runs, backend):
    """DDP broadcasts rank 0's buffers at each forward, then each rank updates its own copy: at a
    commit the ranks hold different BatchNorm statistics and the next step uses rank 0's. DCP's
    default planner wrote each from whichever rank had less to write (rank 1's for 36 of
    ResNet-18's 60 at step 8), and the resume ended on another model; the buffers are now written
    from rank 0 (backends.LowestRankSavePlanner), the parameters still spread over both ranks."""
    run = two_rank_runs("ddp", backend, "model=resnet18")
    stopped_at_step_8(run, tmp_path)
    _, s = run_train(tmp_path, "parallel=ddp", f"checkpoint={backend}", "model=resnet18")
    assert s["resumed_from_steps"] == [8]
    assert s["model_sha256"] == run[2]["model_sha256"]
    commit = json.loads((ckpt_dir(tmp_path) / "step-000000008" / "COMMIT.json").read_text())
    assert {f for f in commit["files"] if f.endswith(".distcp")} == {"__0_0.distcp", "__1_0.distcp"}


def test_weight_check_rejects_a_resume_that_loaded_no_weights(tmp_path, two_rank_runs, ddp_reference):
    """Negative control for the tolerance above: the same ddp -> single resume, but with fresh
    weights at step 8, must fail the weight check (and the exact hash)."""
    stopped_at_step_8(two_rank_runs("ddp", "dcp_sync"), tmp_path)
    script = tmp_path / "forget_weights.py"
    script.write_text(FORGET_WEIGHTS)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MLFLOW_TRACKING_URI")}
    cmd = [sys.executable, str(script), TRAIN, "experiment=smoke", f"paths.root={tmp_path}",
           "parallel=single", "checkpoint=dcp_sync"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    s = latest_summary(tmp_path)
    assert s["resumed_from_steps"] == [8]
    assert s["sample_order_sha256"] == ddp_reference["sample_order_sha256"]  # everything else resumed
    assert s["model_sha256"] != ddp_reference["model_sha256"]
    gap = weight_gap(final_weights(ckpt_dir(tmp_path)), final_weights(ddp_reference["checkpoint_dir"]))
    print(f"resume with fresh weights: largest relative weight difference {gap:.2e}")
    assert gap > 100 * WEIGHT_RTOL, gap


def test_two_node_rendezvous_on_one_machine(tmp_path, ddp_reference):
    s, _ = run_nodes(tmp_path, tmp_path / "runs" / "two-node", "parallel=ddp", "checkpoint=dcp_sync")
    assert s["world_size"] == 2
    assert s["model_sha256"] == ddp_reference["model_sha256"]
    assert s["sample_order_sha256"] == ddp_reference["sample_order_sha256"]


def test_two_nodes_restart_together_though_their_agents_count_restarts_apart(tmp_path):
    """torchrun on two "nodes", --max-restarts 1: rank 1 killed after step 2 while rank 0 sleeps in
    its step. Node 1's agent restarts its worker (a restart it counts) and re-joins; node 0's agent
    restarts its own because a node is waiting (one it does not count): the workers' restart counts
    differ. The round they agree on the store keeps the new workers off the dead ones' keys: one
    restart, resumed from the rescue of step 2, no gloo connection to a dead worker's address (with
    the restart count as the key prefix, rank 0 read the dead rank 1's address and failed again)."""
    import time

    from helpers import nodes_running

    root = tmp_path / "nodes"
    job = ["parallel=ddp", "trainer.max_steps=5", "checkpoint.every_n_steps=4", "fault.slow_rank=0",
           "fault.slow_seconds=5", "fault.rank=1", "fault.kill_at_step=2",
           "parallel.init_timeout_s=60"]  # fmt: skip
    run_dir, restarts = root / "runs" / "two-node", ("--max-restarts", "1")
    with nodes_running(root, run_dir, tmp_path, *job, agent=restarts) as nodes:
        deadline = time.monotonic() + 240
        while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [n.poll() for n in nodes] == [0, 0], (tmp_path / "node0.log").read_text()[-4000:]
    out = "".join((tmp_path / f"node{i}.log").read_text() for i in range(2))
    assert "connectFullMesh failed" not in out
    s = json.loads((root / "runs" / "two-node" / "summary.json").read_text())
    assert s["finished"] and s["restarts"] == 1 and s["resumed_from_steps"] == [2]


def test_multirun_sweep_over_parallel(tmp_path):
    run_train(tmp_path, "-m", "parallel=single,ddp", "checkpoint=dcp_async")
    files = glob.glob(f"{tmp_path}/multirun/**/summary.json", recursive=True)
    summaries = [json.loads(Path(f).read_text()) for f in files]
    assert sorted(s["world_size"] for s in summaries) == [1, 2]
    assert len({s["sample_order_sha256"] for s in summaries}) == 1  # same global order for any world size
    assert latest_summary(tmp_path) is None  # sweeps write under multirun/, not runs/


def test_unreachable_rendezvous_is_a_clear_error(tmp_path):
    # .invalid never resolves (RFC 2606): nothing leaves this machine
    p, s = run_train(
        tmp_path, "parallel=ddp", "parallel.rdzv_endpoint=nowhere.invalid:29500", "parallel.rdzv_timeout_s=5",
        expect_rc=2,
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert "could not join the rendezvous at nowhere.invalid:29500 (parallel.rdzv_endpoint)" in out
    assert s is None
