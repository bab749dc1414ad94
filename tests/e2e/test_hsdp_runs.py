"""parallel=hsdp through the entry point: 4 gloo ranks, 2 replica groups x 2 shards, on a 2-core
machine. The module shares one uninterrupted run, a two-"node" torchrun job (2 agents x 2 ranks on
loopback) with parallel.shard_size left at its default, the ranks of one node. The same layout from
one command (parallel.shard_size=2, parallel.oversubscribe=true) with a rank killed mid-run and
restarted by the elastic agent ends on its model bit for bit, resumed from the survivors' rescue or
from the commit before; with parallel.spares, a killed rank is replaced in process, its shard from
its replica, and ends there too. Its step-8 checkpoint resumes as fsdp and as ddp on 2 ranks and on
one process within the resharding tolerance (with a negative control). The step and checkpoint
state on the 2-D mesh, in-process: unit/test_hsdp.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import (
    FORGET_WEIGHTS,
    REPO,
    TRAIN,
    WEIGHT_RTOL,
    ckpt_dir,
    entry_env,
    final_weights,
    latest_summary,
    run_nodes,
    run_train,
    weight_gap,
)

pytestmark = pytest.mark.slow

HSDP4 = ["parallel=hsdp", "parallel.nproc_per_node=4", "parallel.shard_size=2", "parallel.oversubscribe=true"]


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    """The uninterrupted hsdp smoke run on two torchrun "nodes" of 2 ranks (dcp_sync, commits at
    steps 4, 8 and 12): (paths.root, what the nodes printed, summary)."""
    root = tmp_path_factory.mktemp("hsdp")
    s, out = run_nodes(
        root, root / "runs" / "two-node", "parallel=hsdp", "checkpoint=dcp_sync", nproc=2, timeout=600
    )
    return root, out, s


def stopped_at_step_8(reference, root) -> None:
    """`root` as the reference run would be had it stopped after its step-8 commit."""
    shutil.copytree(reference, root, symlinks=True, dirs_exist_ok=True)
    shutil.rmtree(ckpt_dir(root) / "step-000000012")


def test_hsdp_on_two_nodes_shards_inside_a_node_and_saves_each_shard_once(hsdp_reference):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from goodput.checkpoint.backends import SafeFileSystemReader
    from goodput.checkpoint.export import model_state
    from goodput.checkpoint.layout import parse_commit
    from goodput.model import SmallCNN, model_sha256
    from goodput.storage.remote import Storage

    root, out, s = hsdp_reference
    assert s["world_size"] == 4 and s["steps"] == 12
    # parallel.shard_size=null: a replica group is a node's ranks (torchrun's LOCAL_WORLD_SIZE)
    assert s["config"]["parallel"]["shard_size"] is None
    assert "hsdp: 2 replica group(s) x 2 shard(s) (mesh replicate x shard)" in out
    step12 = ckpt_dir(root) / "step-000000012"
    commit = json.loads((step12 / "COMMIT.json").read_text())
    assert {f for f in commit["files"] if f.endswith(".distcp")} == {f"__{r}_0.distcp" for r in range(4)}
    # Each replica group holds every shard; DCP keeps one copy of each (its chunks tile the tensor once).
    metadata = SafeFileSystemReader(str(step12)).read_metadata()
    # every rank wrote a part: the planner spreads the one copy over both groups' ranks
    assert {str(i.relative_path) for i in metadata.storage_data.values()} == {
        f"__{r}_0.distcp" for r in range(4)
    }
    md = metadata.state_dict_metadata
    sharded = 0
    for k, m in md.items():
        if isinstance(m, TensorStorageMetadata):
            offsets = [tuple(c.offsets) for c in m.chunks]
            assert len(set(offsets)) == len(offsets), (k, offsets)
            assert sum(c.sizes.numel() for c in m.chunks) == m.size.numel(), k
            sharded += k.startswith("model.") and len(m.chunks) == 2  # split over the 2 shards
    assert sharded == sum(k.startswith("model.") for k in md)
    # model_sha256 is the full unsharded state's: the one the shards export to
    rec = parse_commit((step12 / "COMMIT.json").read_bytes(), "step-000000012")
    model = SmallCNN(num_classes=10, width=32)
    model.load_state_dict(model_state(Storage(str(step12.parent)), rec))
    assert model_sha256(model) == s["model_sha256"]


@pytest.mark.parametrize("rescue", [True, False], ids=["rescued", "regular"])
def test_a_killed_rank_restarts_to_the_same_model(tmp_path, hsdp_reference, rescue):
    """One command, 4 ranks, parallel.shard_size=2: the two-node run's layout. SIGKILL of rank 3
    at step 10 -> the elastic agent restarts all 4 -> the uninterrupted run's model, bit for bit.
    Rescued: the survivors hold every shard (rank 3's in rank 1, the other group): each shard's
    first claimant writes step 10, no collective, and the restart resumes it. Without: from the
    step-8 commit (torch_save: the full state gathered on rank 0, loaded back into the 2-D shards)."""
    _, _, ref = hsdp_reference
    p, s = run_train(
        tmp_path, *HSDP4, "checkpoint=torch_save", "parallel.max_restarts=2", "fault.kill_at_step=10",
        "fault.rank=3", f"checkpoint.rescue={str(rescue).lower()}", timeout=600,
    )  # fmt: skip
    assert "SIGKILL rank 3" in p.stderr
    assert s["restarts"] == 1 and s["resumed_from_steps"] == ([10] if rescue else [8])
    assert s["model_sha256"] == ref["model_sha256"]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]
    if rescue:  # shard 1 can only have come from rank 1; shard 0 from rank 0 or 2
        assert "rescue: rank 1 wrote shard 1/2 of step 10" in p.stderr
        assert s["rescues"]["count"] == 1 and "committed" in s["rescues"]["outcomes"]["0"]


@pytest.mark.serial  # 6 processes on 2 cores under a 5 s collective timeout; an upload done in 4 steps
def test_a_killed_rank_is_replaced_by_a_spare_with_its_shard_from_the_other_replica_group(tmp_path):
    """parallel.spares=2 beside 4 hsdp ranks (2 replica groups x 2 shards): rank 3 killed after
    step 4, then (the spare that took its place) between the two micro-steps of step 10. Each time a
    spare becomes rank 3 without a restart, its shard sent by rank 1, its replica in the other group
    (rank 0, the lowest survivor, holds the other shard), and the survivors build model, EMA and
    optimizer again on the new mesh from the boundary state they hold; the former spare writes its
    shard of the async DCP commit of step 6. The uninterrupted run's model, EMA (evaluated:
    trainer.eval_on=ema) and sample order, bit for bit. On gloo a survivor waiting on another
    survivor notices at parallel.collective_timeout_s: 5 s here."""
    run = [*HSDP4, "checkpoint=dcp_async", "checkpoint.every_n_steps=6", "trainer.micro_batch_size=2",
           "trainer.ema_decay=0.9", "trainer.eval_on=ema"]  # fmt: skip
    _, clean = run_train(tmp_path / "clean", *run, timeout=600)
    p, s = run_train(
        tmp_path / "spared", *run, "parallel.spares=2", "fault.rank=3", "fault.kill_at_step=4",
        "fault.kill_in_step=10", "fault.slow_rank=0", "fault.slow_seconds=0.8", "parallel.max_restarts=1",
        "parallel.collective_timeout_s=5", "parallel.recovery_timeout_s=30", timeout=600,
    )  # fmt: skip
    assert s["model_sha256"] == clean["model_sha256"]
    assert s["val"] == clean["val"]  # evaluated on the EMA
    assert s["sample_order_sha256"] == clean["sample_order_sha256"]
    spared = [r for r in s["recovery"]["per_restart"] if r.get("kind") == "in_process"]
    assert s["restarts"] == 2 and s["recovery"]["in_process"] == 2 and s["rescues"]["count"] == 0
    where = [(r["dead_rank"], r["step"], r["sender"], r["lost_steps"]) for r in spared]
    assert where == [(3, 4, 1, 0), (3, 9, 1, 0)]
    for n, r in enumerate(spared, 1):
        assert f"in-process recovery {n}: rank 3 died (SIGKILL), spare {r['spare']} took its place at step " \
               f"{r['step']} with the state of rank 1" in p.stderr  # fmt: skip


@pytest.mark.parametrize("strategy, world", [("fsdp", 2), ("ddp", 2), ("single", 1)])
def test_the_hsdp_checkpoint_resumes_on_fewer_ranks(tmp_path, hsdp_reference, strategy, world):
    """4 hsdp ranks -> 2 (fsdp shards, or ddp replicas) or one process: the same global batches in
    another summation order, so the weights within WEIGHT_RTOL of the uninterrupted run, the order
    exact."""
    root, _, ref = hsdp_reference
    stopped_at_step_8(root, tmp_path)
    _, s = run_train(tmp_path, f"parallel={strategy}", "checkpoint=dcp_sync")
    assert s["world_size"] == world and s["resumed_from_steps"] == [8]
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]
    gap = weight_gap(final_weights(ckpt_dir(tmp_path)), final_weights(ckpt_dir(root)))
    print(f"hsdp 4 ranks -> {strategy} on {world}: largest relative weight difference {gap:.2e}")
    assert gap < WEIGHT_RTOL, gap


def test_the_weight_check_rejects_an_hsdp_resume_that_loaded_no_weights(tmp_path, hsdp_reference):
    """Negative control for the bound above: the same hsdp -> one process resume, with fresh weights
    at step 8 (in-process: the patch of FORGET_WEIGHTS does not reach forkserver workers)."""
    root, _, ref = hsdp_reference
    stopped_at_step_8(root, tmp_path)
    script = tmp_path / "forget_weights.py"
    script.write_text(FORGET_WEIGHTS)
    cmd = [sys.executable, str(script), TRAIN, "experiment=smoke", f"paths.root={tmp_path}",
           "parallel=single", "checkpoint=dcp_sync"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=entry_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    s = latest_summary(tmp_path)
    assert s["resumed_from_steps"] == [8] and s["sample_order_sha256"] == ref["sample_order_sha256"]
    gap = weight_gap(final_weights(ckpt_dir(tmp_path)), final_weights(ckpt_dir(root)))
    print(f"hsdp -> single resume with fresh weights: largest relative weight difference {gap:.2e}")
    assert gap > 100 * WEIGHT_RTOL, gap
