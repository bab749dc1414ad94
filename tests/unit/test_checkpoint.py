"""Checkpoint manager and backends, in-process on a 1-rank gloo group."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from helpers import make_app, manager

from goodput.checkpoint import BACKENDS, CheckpointConfig, CheckpointManager
from goodput.model import model_sha256
from goodput.monitor import Best, EarlyStopping
from goodput.storage.remote import Storage


def optim_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_save_and_restore_identical_state(tmp_path, dist1, backend):
    mgr = manager(tmp_path, backend, dist1)
    app, counter, sched = make_app(1)
    rng_before = torch.get_rng_state()
    mgr.save(7, app)
    mgr.wait()
    expected = model_sha256(app.model)
    rec = mgr.committed()[0]
    assert rec["step"] == 7 and rec["backend"] == backend and rec["world_size"] == 1 and rec["bytes"] > 0

    torch.manual_seed(999)  # a different RNG state, model and optimizer
    app2, counter2, sched2 = make_app(2)
    got, skipped = mgr.restore(app2, mgr.committed())
    assert got["step"] == 7 and skipped == []
    assert model_sha256(app2.model) == expected
    for a, b in zip(optim_tensors(app.optimizer), optim_tensors(app2.optimizer)):
        assert torch.equal(a, b)
    assert counter2.n == 1 and sched2.state_dict() == sched.state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)  # the saved RNG state came back
    mgr.close()


def test_metrics_and_async_stall(tmp_path, dist1):
    mgr = manager(tmp_path, "dcp_async", dist1)
    app, *_ = make_app(1)
    blocking = mgr.save(1, app)
    mgr.wait()
    (m,) = mgr.drain_metrics()
    assert m["ckpt/total_seconds"] >= blocking > 0 and m["ckpt/bytes"] > 0
    mgr.close()


def test_retention_counts_only_committed(tmp_path, dist1):
    mgr = manager(tmp_path, "dcp_sync", dist1, keep_last=2)
    app, *_ = make_app(1)
    for step in (1, 2, 3, 4):
        mgr.save(step, app)
    mgr.wait()
    # an incomplete newer dir must neither count as one of the kept two nor be deleted by retention
    os.makedirs(tmp_path / "remote" / "step-000000009")
    mgr.save(5, app)
    mgr.wait()
    names = sorted(os.listdir(tmp_path / "remote"))
    assert [r["step"] for r in mgr.committed()] == [5, 4]
    assert "step-000000009" in names and "step-000000003" not in names
    mgr.clean_incomplete()
    assert "step-000000009" not in os.listdir(tmp_path / "remote")


def _corrupt(path, how: str):
    if how == "truncate_shard":
        shard = next(p for p in os.listdir(path) if p.endswith(".distcp"))
        with open(os.path.join(path, shard), "r+b") as f:
            f.truncate(100)
    elif how == "garble_metadata":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(b"not a pickle at all")
    elif how == "delete_commit":
        os.remove(os.path.join(path, "COMMIT.json"))
    elif how == "garble_commit":
        with open(os.path.join(path, "COMMIT.json"), "w") as f:
            f.write("{oops")


@pytest.mark.parametrize("how", ["truncate_shard", "garble_metadata", "delete_commit", "garble_commit"])
def test_corrupt_newest_falls_back_to_previous(tmp_path, dist1, how):
    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(1)
    mgr.save(1, app)
    good = model_sha256(app.model)
    app.model.head.weight.data.add_(1.0)
    mgr.save(2, app)
    mgr.wait()
    _corrupt(tmp_path / "remote" / "step-000000002", how)
    app2, *_ = make_app(5)
    rec, skipped = mgr.restore(app2, mgr.committed())
    assert rec["step"] == 1
    assert model_sha256(app2.model) == good
    # a size check catches truncation and metadata edits before loading; others fail in load
    if how in ("delete_commit", "garble_commit"):
        assert skipped == []  # not even a candidate: without a valid commit it is incomplete
    # never deleted: it could be someone's only copy
    assert os.path.isdir(tmp_path / "remote" / "step-000000002")


def test_checkpoint_of_another_model_is_refused(tmp_path, dist1):
    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(1, width=8)
    mgr.save(1, app)
    mgr.wait()
    other, *_ = make_app(1, width=16)
    rec, skipped = mgr.restore(other, mgr.committed())
    assert rec is None and len(skipped) == 1 and "step-000000001" in skipped[0]


@pytest.mark.parametrize(
    "scheme, backend", [("memory", "dcp_sync"), ("s3", "dcp_async"), ("s3", "torch_save")]
)
def test_fsspec_remotes(tmp_path, dist1, request, scheme, backend):
    # s3:// goes to moto's S3 server on loopback, through s3fs: the path a real bucket takes
    remote = (
        "memory://goodput-test/ckpt"
        if scheme == "memory"
        else f"s3://{request.getfixturevalue('s3_bucket')}/ckpt"
    )
    mgr = manager(tmp_path, backend, dist1, remote=remote)
    app, *_ = make_app(1)
    mgr.save(3, app)
    mgr.wait()
    app2, *_ = make_app(2)
    rec, _ = mgr.restore(app2, mgr.committed())
    assert rec["step"] == 3 and model_sha256(app2.model) == model_sha256(app.model)


def test_resaving_a_step_moves_the_old_dir_aside(tmp_path, dist1):
    """After resuming from an older step the run saves steps that exist from the abandoned lineage:
    never write into them (an old COMMIT.json beside new shards could look complete)."""
    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(1)
    mgr.save(1, app)
    mgr.save(2, app)
    relaunch = manager(tmp_path, "dcp_sync", dist1)
    relaunch.committed()  # discovery at start lists what is there
    app.model.head.weight.data.add_(1.0)
    relaunch.save(2, app)
    names = os.listdir(tmp_path / "remote")
    assert any(n.startswith("step-000000002.superseded-") for n in names)
    assert [r["step"] for r in relaunch.committed()] == [2, 1]
    target, *_ = make_app(3)
    rec, _ = relaunch.restore(target, relaunch.committed())
    assert rec["step"] == 2 and model_sha256(target.model) == model_sha256(app.model)


# -- another process's write is seen at once (no per-client listing cache) -----------------------
def other_process_storage(url: str) -> Storage:
    """A Storage with its own fsspec client, as a separate rank's process has (in one process
    fsspec would otherwise hand both the same cached client, whose own writes refresh its cache)."""
    s = Storage(url)
    s._pid = -1  # the `fs` property then builds a fresh client, as after a fork
    assert s.fs is not Storage(url).fs
    return s


def test_listings_see_another_clients_write(s3_bucket):
    url = f"s3://{s3_bucket}/run"
    mine, theirs = Storage(url), other_process_storage(url)
    mine.write_bytes("attempts/0.json", b"{}")
    assert set(mine.ls("attempts")) == {"0.json"} and set(mine.find("attempts")) == {"0.json"}
    assert not mine.exists("attempts/1.json")
    theirs.write_bytes("attempts/1.json", b"{}")  # after my listing: a cached client misses it
    assert set(mine.ls("attempts")) == {"0.json", "1.json"}
    assert set(mine.find("attempts")) == {"0.json", "1.json"}
    assert mine.exists("attempts/1.json")


def test_commit_sees_a_manifest_that_lands_after_the_first_listing(tmp_path, s3_bucket):
    """Rank 1's manifest arrives after rank 0's commit has listed `ranks/` once (the order that
    hung a 2-rank S3 job for its whole commit timeout): rank 0 must commit within a second."""
    import threading
    import time

    remote = f"s3://{s3_bucket}/ckpt"
    node = {"_target_": "goodput.checkpoint.backends.TorchSave"}

    def mgr(rank, storage):
        cfg = CheckpointConfig(node, remote, str(tmp_path / f"staging{rank}"), 5, None, 2)
        cfg.commit_timeout_s = 5.0
        return CheckpointManager(cfg, storage, BACKENDS["torch_save"](), rank, 2, rank)

    rank0, rank1 = mgr(0, Storage(remote)), mgr(1, other_process_storage(remote))
    local0, local1 = tmp_path / "local0", tmp_path / "local1"
    local0.mkdir(), local1.mkdir()
    (local0 / "state.pt").write_bytes(b"x" * 100)
    files0 = rank0._upload(5, str(local0))

    listed = threading.Event()
    ls = rank0.storage.ls

    def ls_then_signal(rel=""):
        out = ls(rel)
        if rel.endswith("/ranks"):
            listed.set()
        return out

    rank0.storage.ls = ls_then_signal
    landed = []

    def rank1_uploads_late():
        listed.wait(10)
        rank1._upload(5, str(local1))
        landed.append(time.monotonic())

    th = threading.Thread(target=rank1_uploads_late)
    th.start()
    try:
        rank0._commit(5, str(local0), files0, {})
        committed = time.monotonic()
    finally:
        th.join()
    assert listed.is_set() and landed
    assert committed - landed[0] < 1.0, f"commit {committed - landed[0]:.2f}s after the last manifest"
    rec = rank0.committed()[0]
    assert rec["step"] == 5 and rec["world_size"] == 2 and set(rec["files"]) == {"state.pt"}


def test_the_job_process_checks_commits_without_a_backend_or_staging(tmp_path, dist1, monkeypatch):
    """goodput.run.job.prepare lists, verifies and resolves the run's commits through a read-only
    view of checkpoint.dir: it never builds the checkpoint backend nor creates checkpoint.staging_dir
    (a non-leader rank: no demo data, lock or MLflow run, only the checks)."""
    from helpers import REPO
    from hydra import compose, initialize_config_dir
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from goodput.run.job import AlreadyDone, prepare

    def compose_job(*overrides):
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
            return compose("train", overrides=["experiment=smoke", f"paths.root={tmp_path}", *overrides])

    ck = OmegaConf.to_container(compose_job(), resolve=True)["checkpoint"]
    writer = manager(tmp_path, "torch_save", dist1, remote=ck["dir"])  # stages in tmp_path/staging
    app, _, _ = make_app(1)
    writer.save(7, app)
    writer.wait()
    assert not os.path.exists(ck["staging_dir"])

    cls = get_class(ck["backend"]["_target_"])
    built_by, init = [], cls.__init__

    def recorded_init(self, *a, **kw):  # which goodput module built a backend (through instantiate)
        f = sys._getframe(1)
        while not f.f_globals.get("__name__", "").startswith("goodput"):
            f = f.f_back
        built_by.append(f.f_globals["__name__"])
        init(self, *a, **kw)

    monkeypatch.setattr(cls, "__init__", recorded_init)
    monkeypatch.setenv("RANK", "1")
    step7 = f"{ck['dir']}/step-000000007"
    with pytest.raises(AlreadyDone, match="is complete: it reached step 7"):  # listed and verified
        prepare(compose_job("trainer.max_steps=7"), str(tmp_path / "run"))
    prepare(compose_job("trainer.max_steps=7", f"run.resume={step7}"), str(tmp_path / "run"))
    with pytest.raises(FileNotFoundError, match="not a committed checkpoint"):
        prepare(compose_job(f"run.resume={ck['dir']}/step-000000003"), str(tmp_path / "run"))
    (f,) = [n for n in os.listdir(step7) if n not in ("COMMIT.json", "ranks")]
    with open(os.path.join(step7, f), "r+b") as fh:  # same size, other bytes: not trusted
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))
    prepare(compose_job("trainer.max_steps=7"), str(tmp_path / "run"))  # no "already done"
    assert not os.path.exists(ck["staging_dir"])
    assert built_by == ["goodput.config"] * 4  # validate's check of the node only, once per job


def test_advise_names_the_run_of_the_newest_intact_commit(tmp_path, dist1):
    """`advise <checkpoint dir>` takes the MLflow run from the newest commit by the same rules as
    resume: a newer step dir whose files are missing is skipped, the older intact commit names it."""
    from goodput.calculator.advise import run_id

    mgr = manager(tmp_path, "torch_save", dist1)
    app, _, _ = make_app(1)
    for step, rid in ((3, "a" * 32), (5, "b" * 32)):
        mgr.commit_info = {"mlflow_run_id": rid}
        mgr.save(step, app)
        mgr.wait()
    remote = tmp_path / "remote"
    assert run_id(str(remote)) == "b" * 32
    (f,) = [p for p in (remote / "step-000000005").iterdir() if p.name not in ("COMMIT.json", "ranks")]
    f.unlink()
    assert run_id(str(remote)) == "a" * 32


def _monitors():
    return EarlyStopping(3, "val/loss", 0.01, None), Best("val/loss", None)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_early_stopping_resumes_part_way_to_its_patience(tmp_path, dist1, backend):
    """Saved two evaluations into a patience of three, with a best value: the restored monitors are
    the saved ones, and the next evaluation without an improvement stops both at the same step."""
    es, best = _monitors()
    for step, loss in enumerate([1.0, 0.8, 0.795, 0.85], start=1):  # 0.795 is within min_delta
        es.update({"val/loss": loss}, step)
        best.observe({"val/loss": loss}, step)
    assert (es.bad, es.best, best.step, best.value) == (2, 0.8, 3, 0.795)
    app, *_ = make_app(0)
    app.register("early_stopping", es)
    app.register("best", best)
    mgr = manager(tmp_path, backend, dist1)
    mgr.save(4, app)
    mgr.wait()

    es2, best2 = _monitors()
    app2, *_ = make_app(1)
    app2.register("early_stopping", es2)
    app2.register("best", best2)
    rec, skipped = mgr.restore(app2, mgr.committed())
    mgr.close()
    assert rec["step"] == 4 and skipped == []
    assert es2.state_dict() == es.state_dict() and best2.state_dict() == best.state_dict()
    assert es.update({"val/loss": 0.9}, 5) and es2.update({"val/loss": 0.9}, 5)


def test_every_save_and_the_last_wait_are_phases(tmp_path, dist1):
    """The checkpoint manager declares its blocking parts: each save (with the wait for the previous
    upload inside it) and the wait for the last upload after the loop."""
    import contextlib

    mgr, seen = manager(tmp_path, "dcp_async", dist1), []

    @contextlib.contextmanager
    def phase(what):
        seen.append(what)
        yield

    mgr.phase = phase
    app, *_ = make_app(1)
    mgr.save(1, app)
    mgr.save(2, app)
    mgr.wait()
    mgr.close()
    assert seen[:3] == ["checkpoint save of step 1", "checkpoint save of step 2",
                        "waiting for the last checkpoint upload"]  # fmt: skip


def test_the_planner_writes_the_buffers_from_the_lowest_rank_and_spreads_the_rest():
    """Two ranks' plans over the same replicated entries: every key in `keys` is written by rank 0,
    the other replicated tensors by both ranks (DCP's load balancing), and a chunk at another
    offset (a shard of a tensor) by the rank that holds it."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from goodput.checkpoint.backends import LowestRankSavePlanner, lowest_rank_keeps

    sd = {f"model.w{i}": torch.ones(8) for i in range(6)}
    sd |= {f"model.bn{i}.running_mean": torch.ones(8) for i in range(6)}
    keys = frozenset(k for k in sd if "running" in k)
    planners = [LowestRankSavePlanner(keys) for _ in range(2)]
    for r, p in enumerate(planners):
        p.set_up_planner(sd, is_coordinator=r == 0)
    plans = [p.create_local_plan() for p in planners]
    global_plan, _ = planners[0].create_global_plan(plans)
    written = [{i.index.fqn for i in p.items} for p in global_plan]
    assert keys <= written[0] and not keys & written[1]
    assert written[0] - keys and written[1]  # the weights still spread over both ranks
    assert set().union(*written) == set(sd) and not written[0] & written[1]

    shard = plans[1].items[0]
    shard = dataclasses.replace(shard, index=MetadataIndex(shard.index.fqn, torch.Size([8])))
    keys = frozenset({shard.index.fqn})
    kept = lowest_rank_keeps([plans[0], dataclasses.replace(plans[1], items=[shard])], keys)
    assert kept[1].items == [shard]


@pytest.mark.parametrize(
    "saved, stops",
    [
        ({"classes": ["cat", "dog"]}, False),  # the same classes
        ({"classes": ["cat", "cow"]}, True),  # renamed: the same count would load, mislabelled
        ({"classes": ["cat"]}, True),
        (None, False),  # a commit written before model records: let through
        ({"classes": "cat,dog"}, False),  # a crafted record is not trusted to stop a run either
        ("junk", False),
    ],
)
def test_a_commit_of_other_classes_stops_the_restore_once_its_bytes_verify(tmp_path, dist1, saved, stops):
    from goodput.errors import IncompatibleCheckpoint

    m = manager(tmp_path, "dcp_sync", dist1)
    m.commit_info["model"] = {"classes": ["cat", "dog"]}
    app = make_app(1)[0]
    m.save(1, app)
    m.wait()
    [rec] = m.committed()
    rec = {**rec, "model": saved}
    if stops:
        with pytest.raises(IncompatibleCheckpoint, match=r"its model was trained on the classes .*"
                           r"the data has 2 \(cat, dog\)"):  # fmt: skip
            m.restore(app, [rec])
        assert [r["step"] for r in m.committed()] == [1]  # still committed: not moved aside
    else:
        assert m.restore(app, [rec])[0]["step"] == 1
    m.close()


def test_a_commit_of_other_classes_whose_bytes_do_not_verify_is_skipped_not_refused(tmp_path, dist1):
    """Its class list decides nothing: a junk step dir (sizes right, checksums wrong) with an edited
    class list falls back to the commit before it, as any corrupt commit does."""
    m = manager(tmp_path, "dcp_sync", dist1)
    m.commit_info["model"] = {"classes": ["cat", "dog"]}
    app = make_app(1)[0]
    for step in (1, 2):
        m.save(step, app)
        m.wait()
    junk, good = m.committed()
    shard = tmp_path / "remote" / junk["dir"] / next(n for n in junk["files"] if n.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    shutil.rmtree(tmp_path / "staging" / junk["dir"])  # no node-local copy to serve it
    rec, skipped = m.restore(app, [{**junk, "model": {"classes": ["cat", "cow"]}}, good])
    assert (
        rec["step"] == 1 and len(skipped) == 1 and "step-000000002" in skipped[0] and "cow" not in skipped[0]
    )
    m.close()


def _one_rank_differs(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks (two nodes: a staging dir and a data copy each) restoring a commit that
    only rank 1's view contradicts: first its classes, then its training images, replaced in place
    under the same names (the job's loader, registered as the job does). What each restore said
    goes to `<out>/rank<r>-<what>`."""
    import torch.distributed as dist
    from helpers import end_gloo_rank

    from goodput.data.config import DataConfig
    from goodput.data.loader import ResumableLoader
    from goodput.errors import IncompatibleCheckpoint
    from goodput.parallel import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    d = init_distributed(timeout_s=30)
    remote = os.path.join(out, "remote")
    node = {"_target_": f"goodput.checkpoint.backends.{BACKENDS['dcp_sync'].__name__}"}
    cfg = CheckpointConfig(node, remote, f"{out}/staging{rank}", None, None, 3)
    m = CheckpointManager(cfg, Storage(remote), BACKENDS["dcp_sync"](), rank, 2, 0, pg=d.ckpt_pg)
    classes = {"classes": ["cat", "dog"]}
    m.commit_info["model"] = classes
    app = make_app(1)[0]
    app.rank = rank
    root = os.path.join(out, f"data{rank}")
    dc = DataConfig(
        source={"_target_": "goodput.data.sources.RemoteSource"}, root=root, image_size=16,
        num_workers=0, cache_dir=os.path.join(out, f"cache{rank}"),
    )  # fmt: skip
    app.register("data", ResumableLoader(dc, Storage(root), 5, 8, 4, rank, 2, torch.device("cpu")))
    m.save(1, app)  # a real commit: what it records is checked once its bytes verify
    m.wait()
    dist.barrier()
    for what in ("classes", "data"):
        m.commit_info["model"] = (
            {"classes": ["cat", "dog", "zebra"]} if rank == 1 and what == "classes" else classes
        )
        if rank == 1 and what == "data":
            files = app.parts["data"].files.files
            for a, b in zip(files, files[1:] + files[:1]):  # each image's bytes now its neighbour's
                shutil.copyfile(os.path.join(out, "data0", b), os.path.join(root, a))
            app.parts["data"] = ResumableLoader(dc, Storage(root), 5, 8, 4, rank, 2, torch.device("cpu"))
        try:
            m.restore(app, m.committed())
            said = "restored"
        except IncompatibleCheckpoint as e:
            said = f"refused: {e}"
        except Exception as e:  # a collective one rank left: not the refusal
            said = f"{type(e).__name__}: {e}"
        with open(os.path.join(out, f"rank{rank}-{what}"), "w") as f:
            f.write(said)
    end_gloo_rank()


@pytest.mark.slow
def test_what_only_one_rank_sees_differ_stops_every_rank_with_the_refusal(tmp_path):
    """Each rank lists the data itself (a node's own mount, a stale copy): when only rank 1's
    classes differ from the commit's, or only its training images were replaced in place under the
    same names, rank 0 must not go on into the load's collectives alone (a hang, or a peer's broken
    connection), nor load on: every rank stops with the refusal."""
    import torch.multiprocessing as mp

    from goodput.data.synthetic import make_dataset
    from goodput.parallel import free_port

    make_dataset(str(tmp_path / "data0"), num_classes=2, train_per_class=8, val_per_class=1, image_size=16)
    shutil.copytree(tmp_path / "data0", tmp_path / "data1")
    mp.spawn(_one_rank_differs, args=(free_port(), str(tmp_path)), nprocs=2)
    got = {w: [(tmp_path / f"rank{r}-{w}").read_text() for r in range(2)] for w in ("classes", "data")}
    said = got["classes"]
    assert said[0].startswith("refused:") and "differ from the checkpoint's on another rank" in said[0], got
    assert said[1].startswith("refused:") and "the data has 3 (cat, dog, zebra)" in said[1], got
    said = got["data"]
    assert said[0].startswith("refused:") and "refused on another rank" in said[0], got
    assert said[1].startswith("refused:") and "files were replaced in place" in said[1], got
