"""Rescue checkpoints through the entry point and the elastic agent (goodput.checkpoint.rescue):
a rank killed at step 73 of a 2-rank job that commits every 50 costs no step (the survivor's
rescue is resumed, to the uninterrupted run's model bit for bit) where without the rescue it costs
23; fsdp's ranks each rescue their shard when one of them fails in its step; a hang inside the
optimizer update writes no rescue; a whole "node" lost of a two-agent job is rescued by the other
node and the relaunch on the one node left resumes it. In-process: unit/test_rescue.py."""

from __future__ import annotations

import json
import os

import pytest
from helpers import await_step, ckpt_dir, final_weights, kill_node, nodes_running, run_train, weight_gap

from goodput.checkpoint.commits import Commits
from goodput.resilience.accounting import Rescues
from goodput.storage.remote import Storage

pytestmark = pytest.mark.slow

LONG = ["trainer.max_steps=80", "checkpoint.every_n_steps=50", "checkpoint=dcp_async"]
# 40 steps, commits every 10, rank 0 a tenth of a second slower per step: a kill lands mid-run
SLOW = ["trainer.max_steps=40", "checkpoint.every_n_steps=10", "fault.slow_rank=0", "fault.slow_seconds=0.1"]


@pytest.fixture(scope="module")
def ddp80(tmp_path_factory):
    """The uninterrupted 2-rank run of 80 steps, commits every 50."""
    _, s = run_train(tmp_path_factory.mktemp("ddp80"), "parallel=ddp", *LONG)
    return s


def test_a_rank_killed_at_step_73_costs_no_step(tmp_path, ddp80):
    kill = ["parallel=ddp", *LONG, "parallel.max_restarts=1", "fault.kill_at_step=73", "fault.rank=1"]
    p, s = run_train(tmp_path / "on", *kill)
    assert "SIGKILL rank 1 (kill_at_step-73)" in p.stderr
    assert "rescue: rank 0 wrote shard 0/1 of step 73" in p.stderr
    assert s["restarts"] == 1 and s["resumed_from_steps"] == [73]
    assert s["model_sha256"] == ddp80["model_sha256"]
    assert s["sample_order_sha256"] == ddp80["sample_order_sha256"]
    assert s["rescues"]["count"] == 1 and s["rescues"]["steps_saved"] == 23
    assert [r["lost_steps"] for r in s["recovery"]["per_restart"]] == [0]
    assert [r["resumed_kind"] for r in s["recovery"]["per_restart"]] == ["rescue"]
    assert s["goodput"]["rescue_seconds"] > 0
    # without it, the same kill costs the 23 steps since the step-50 commit
    _, off = run_train(tmp_path / "off", *kill, "checkpoint.rescue=false")
    assert off["resumed_from_steps"] == [50] and off["model_sha256"] == ddp80["model_sha256"]
    assert [r["lost_steps"] for r in off["recovery"]["per_restart"]] == [23]
    assert off["rescues"]["count"] == 0


def test_fsdp_ranks_each_rescue_their_shard_when_one_fails_in_its_step(tmp_path):
    """fault.raise_at_step: rank 1's step raises after its forward (a bad batch). It writes its
    shard and exits; rank 0's next collective fails, it writes its shard and, finding both there,
    commits. The relaunch resumes step 6, not the step-4 commit, to the uninterrupted model."""
    fsdp = ["parallel=fsdp", "checkpoint=dcp_sync"]
    _, ref = run_train(tmp_path / "ref", *fsdp)
    p, s = run_train(
        tmp_path / "a", *fsdp, "parallel.max_restarts=1", "fault.raise_at_step=7", "fault.rank=1"
    )
    assert "rescue: rank 1 wrote shard 1/2 of step 6" in p.stderr
    assert "rescue: rank 0 wrote shard 0/2 of step 6" in p.stderr and "and committed it" in p.stderr
    assert s["resumed_from_steps"] == [6] and s["model_sha256"] == ref["model_sha256"]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]
    outcomes = {r["rank"]: r["outcome"] for r in Rescues(Storage(str(ckpt_dir(tmp_path / "a")))).records()}
    assert sorted(outcomes.values()) == ["committed", "written"]


def test_a_hang_inside_the_optimizer_update_writes_no_rescue(tmp_path):
    """The update hang site: the watchdog ends the rank with its parameters (as far as anyone
    knows) half-written. It must not write them: the restart resumes the regular step-4 commit."""
    p, s = run_train(
        tmp_path, "parallel.max_restarts=1", "fault.hang_site=update", "fault.hang_at_step=5",
        "trainer.hang_timeout_s=3", timeout=300,
    )  # fmt: skip
    assert "hangs at update (step 5)" in p.stderr and "inside an optimizer update" in p.stderr
    assert s["resumed_from_steps"] == [4]
    records = Rescues(Storage(str(ckpt_dir(tmp_path)))).records()
    assert [(r["outcome"], r["step"], r["reached"]) for r in records] == [("in_update", None, 5)]
    assert not [d for d in os.listdir(ckpt_dir(tmp_path)) if d.endswith(".rescue")]


def test_a_lost_node_is_rescued_by_the_other_and_the_job_resumes_on_the_one_left(tmp_path):
    """Two torchrun agents on loopback, one rank each (ddp). Once training is under way the whole
    second "node" (its agent and its rank) is SIGKILLed. The first node's rank rescues the last
    finished step; the relaunch on that node alone (one process: the global batch is kept, the
    rank takes all of it) resumes it: the sample order continues exactly, and the model is the one
    of a one-node job that lost rank 1 at the same step and resumed the same way, bit for bit."""
    ref_root, root = tmp_path / "ref", tmp_path / "lost"
    _, ref = run_train(ref_root, "parallel=ddp", *SLOW)
    with nodes_running(root, root / "runs" / "two-node", tmp_path, "parallel=ddp", *SLOW) as nodes:
        await_step(root, nodes, 13, 16, tmp_path / "node0.log")  # past the step-10 commit, before 20
        kill_node(nodes[1].pid)
        nodes[0].wait(timeout=120)
    out = (tmp_path / "node0.log").read_text()
    assert "rescue: rank 0 wrote shard 0/1 of step" in out, out[-4000:]
    rec = Commits(Storage(str(ckpt_dir(root)))).committed()[0]
    assert rec["kind"] == "rescue" and rec["rescued_by"] == [0] and rec["world_size"] == 2
    assert rec["step"] % 10, "the rescue is between two regular commits"
    _, s = run_train(root, "parallel=single", *SLOW)
    assert s["world_size"] == 1 and s["resumed_from_steps"] == [rec["step"]]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]
    assert json.loads(json.dumps(s["rescues"]))["count"] == 1
    # The uninterrupted run is not the reference for the weights: from the rescued step on, one
    # process sums the gradients in another order, and what that rounding grows to depends on the
    # step (resumed at step 10, 13 or 14 of this job: 1.2e-4 relative; at 15, 16 or 20: under 1e-6). The
    # same loss on one node is: rank 1 of a one-node job killed at that step, its rescue resumed
    # on one process. Same state at the step, same world size after it: the same model.
    one = tmp_path / "one"
    run_train(one, "parallel=ddp", *SLOW, "fault.rank=1", f"fault.kill_at_step={rec['step']}", expect_rc=None)
    alike = Commits(Storage(str(ckpt_dir(one)))).committed()[0]
    assert (alike["kind"], alike["step"]) == ("rescue", rec["step"])
    _, s1 = run_train(one, "parallel=single", *SLOW)
    assert s["model_sha256"] == s1["model_sha256"]
    # and both are near the uninterrupted run's (a resume that loaded no weights is 1.8 away)
    gap = weight_gap(final_weights(ckpt_dir(root)), final_weights(ckpt_dir(ref_root)))
    print(f"two nodes -> one after a lost node: largest relative weight difference {gap:.2e}")
    assert gap < 1e-2, gap
