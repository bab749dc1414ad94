"""parallel.spares through the entry point and the elastic agent (goodput.run.spares): rank 1 of a
2-rank DDP job killed twice, once between steps and once between the micro-steps of a step, each
time replaced by a warm spare without a restart, ends bit for bit on the uninterrupted run's model
and sample order; what does not fit (a rank's own error, a kill inside a save) takes the rescue and
restart path as without spares, in the same run, and ends there too; a preemption notice still
commits and exits 0 (a rank ended as hung exits 124: the host's branch of the own error's exit 1).
The decisions, their bounds and a waiting spare's CPU: unit/test_spares.py."""

from __future__ import annotations

import json

import pytest
from helpers import run_train

pytestmark = pytest.mark.slow

# 50 steps of 2 micro-steps per rank, a commit at step 25, rank 0 0.15 s slower per step: the spares
# are built and waiting when the kills come
BASE = ["parallel=ddp", "trainer.max_steps=50", "checkpoint.every_n_steps=25", "trainer.micro_batch_size=4",
        "data.num_workers=1", "fault.slow_rank=0", "fault.slow_seconds=0.15"]  # fmt: skip


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    _, s = run_train(tmp_path_factory.mktemp("clean"), *BASE)
    return s


def test_kills_are_recovered_onto_spares_and_what_does_not_fit_restarts_all_to_the_clean_model(
    tmp_path, clean
):
    """Rank 1, four times: killed after step 12 (a spare takes its place), its own error in step 18
    (a bad batch, not a peer lost: the group restarts from the rescue of step 17), killed while the
    step-25 commit uploads (rank 0 is inside that save: the restart), killed between the two
    micro-steps of step 45 (a spare of the restarted group takes its place: the survivor stood at
    the end of step 44). In-process: no process of the survivors restarts, the step in flight is
    redone. Every way, the uninterrupted run's model and sample order."""
    faults = ["fault.rank=1", "fault.kill_at_step=12", "fault.raise_at_step=18", "fault.kill_during_save=25",
              "fault.kill_in_step=45", "parallel.max_restarts=2",
              "parallel.recovery_timeout_s=5"]  # fmt: skip
    p, s = run_train(tmp_path, *BASE, "parallel.spares=1", *faults)
    assert s["model_sha256"] == clean["model_sha256"]
    assert s["sample_order_sha256"] == clean["sample_order_sha256"]  # no sample lost or seen twice
    rec = s["recovery"]
    assert s["restarts"] == 4 and rec["in_process"] == 2 and s["rescues"]["count"] == 2
    spared = [r for r in rec["per_restart"] if r.get("kind") == "in_process"]
    where = [(r["attempt"], r["dead_rank"], r["step"], r["lost_steps"]) for r in spared]
    assert where == [(0, 1, 12, 0), (2, 1, 44, 0)]
    for r in spared:
        assert list(r["seconds"]) == ["detected", "group_rebuilt", "state_sent", "loader_ready", "first_step"]
        assert r["failure_source"] == "fault_marker"
        assert r["total_seconds"] == pytest.approx(sum(r["seconds"].values()), abs=1e-3)
    assert s["goodput"]["in_process_recoveries"] == 2
    for n, r in enumerate(spared, 1):
        assert f"in-process recovery {n}: rank 1 died (SIGKILL), spare {r['spare']} took its place at step " \
               f"{r['step']}" in p.stderr  # fmt: skip
    assert "rank 1 exited with status 1" in p.stderr  # its own error: the restart
    assert "no in-process recovery (rank 0: inside a checkpoint save)" in p.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = s["mlflow_run_id"]
    assert len(client.get_metric_history(run, "recovery/total_seconds")) == 4  # restarts and in-process
    assert client.get_run(run).data.tags["recovery.2.replaced"] == f"rank 1 by spare {spared[1]['spare']}"


def test_a_spare_that_waited_long_replaces_a_rank_of_an_attempt_resumed_before_its_evaluation(
    tmp_path, clean
):
    """Rank 1 killed after step 10, whose evaluation is due (trainer.eval_every_n_steps=10): rank 0
    stands before it, so the group restarts from the rescue of step 10, which evaluates step 10
    first. Then rank 1 killed inside step 48, at least 22 s later (0.6 s a step): this attempt's
    spare waited past its first-step bound (parallel.init_timeout_s=20: its clock starts when it
    takes the place, not when it was built), and rank 0's loop, run again from step 47, does not
    evaluate step 10 again (the spare would not: their collectives would pair wrongly). The place
    is taken in process; the clean model and sample order."""
    base = [o for o in BASE if not o.startswith("fault.slow_seconds")]
    faults = ["fault.slow_seconds=0.6", "trainer.eval_every_n_steps=10", "fault.rank=1",
              "fault.kill_at_step=10", "fault.kill_in_step=48", "parallel.max_restarts=1",
              "parallel.recovery_timeout_s=5", "parallel.init_timeout_s=20",
              "trainer.hang_timeout_s=5"]  # fmt: skip
    p, s = run_train(tmp_path, *base, "parallel.spares=1", *faults)
    assert s["model_sha256"] == clean["model_sha256"]
    assert s["sample_order_sha256"] == clean["sample_order_sha256"]
    assert "no in-process recovery (rank 0: before the evaluation of step 10 was done)" in p.stderr
    spared = [r for r in s["recovery"]["per_restart"] if r.get("kind") == "in_process"]
    assert s["restarts"] == 2 and s["resumed_from_steps"] == [10]
    assert [(r["attempt"], r["dead_rank"], r["step"]) for r in spared] == [(1, 1, 47)]


def test_a_preemption_notice_still_checkpoints_and_exits_0_with_spares(tmp_path):
    """SIGTERM to the job's process group (as a scheduler sends it) while a spare waits: the ranks
    commit the step they stand at and exit 0, the spare exits 0, every host returns (none is taken
    for a failed worker): the job exits 0 and says where it stopped."""
    import os
    import signal
    import time

    from helpers import start_train, train_cmd

    log = tmp_path / "out.log"
    with open(log, "w") as out:
        p = start_train(train_cmd(tmp_path, *BASE, "parallel.spares=1"), out)
        try:
            deadline = time.monotonic() + 240
            while "ready in" not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2.0)  # a few steps on
            os.killpg(p.pid, signal.SIGTERM)
            assert p.wait(120) == 0, log.read_text()[-4000:]
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert "received SIGTERM: checkpointed step" in text
    assert "SIGTERM while waiting: exiting" in text  # the spare
    assert "stopped by SIGTERM at step" in text


def test_a_lost_node_is_replaced_by_a_spare_on_the_other_node_without_a_restart(tmp_path, clean):
    """Two torchrun agents on loopback, one rank and one spare each (parallel.spares is per node).
    The whole node of rank 1 is SIGKILLed once training is under way: agent, host, rank 1 and its
    spare, so nobody reports rank 1's death (rank 0's node stays: its agent hosts the store the
    workers share). Rank 0's host sees the other's heartbeat stand still, declares it lost and
    decides in its place: the spare on rank 0's node (not the lost node's, dead) takes rank 1 at the
    step rank 0 stands at. No restart, and the uninterrupted one-node job's model and sample order,
    bit for bit. (torch's agent on the node left then waits at its exit barrier for the lost agent,
    300 s: the test ends it once the run is done.)"""
    import time

    from helpers import await_step, kill_node, nodes_running

    root = tmp_path / "nodes"
    with nodes_running(root, root / "runs" / "two-node", tmp_path, *BASE, "parallel.spares=1") as nodes:
        await_step(root, nodes, 13, 16, tmp_path / "node0.log")  # both spares waiting (built before step 1)
        # which node runs rank 0 is the rendezvous's choice
        keep = next(i for i in range(2) if " rank0 " in (tmp_path / f"node{i}.log").read_text())
        kept = tmp_path / f"node{keep}.log"
        kill_node(nodes[1 - keep].pid)
        deadline = time.monotonic() + 120
        while "done: 50 steps" not in kept.read_text():
            assert nodes[keep].poll() is None, kept.read_text()[-4000:]
            assert time.monotonic() < deadline, kept.read_text()[-4000:]
            time.sleep(0.2)
    text = kept.read_text()
    with open(root / "runs" / "two-node" / "summary.json") as f:
        s = json.load(f)
    assert s["model_sha256"] == clean["model_sha256"]
    assert s["sample_order_sha256"] == clean["sample_order_sha256"]
    assert s["restarts"] == 1 and s["recovery"]["in_process"] == 1 and not s["resumed_from_steps"]
    (r,) = s["recovery"]["per_restart"]
    assert (r["kind"], r["dead_rank"], r["lost_steps"]) == ("in_process", 1, 0)
    assert r["cause"].startswith("node lost: host 1's heartbeat stood still")
    assert "host 0: host 1 is lost (ranks [1] with it" in text
    spare = [line for line in text.splitlines() if "ready in" in line][0].split()[3]  # the kept node's
    assert f"spare {spare.removeprefix('spare')} is rank 1 now" in text
