"""Rescue checkpoints in-process: a failure inside a step writes the step before it (the loader's
position, BatchNorm statistics and random streams put back to the boundary) and the relaunch ends
on the uninterrupted run's model; the update window writes nothing; a rescue that runs out of time
or is killed mid-write is never loaded; the store's one-winner claims; the records it leaves,
checked as untrusted input. Through the entry point and the elastic agent: e2e/test_rescue_runs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import ckpt_dir, make_app, manager, run_job_here

from goodput.checkpoint import rescue as rescue_mod
from goodput.checkpoint.commits import Commits
from goodput.checkpoint.layout import COMMIT, is_rescue, newest_first, parse_step, step_dir
from goodput.checkpoint.rescue import merge_metadata, write_shard
from goodput.resilience.accounting import Rescues
from goodput.resilience.fault import InjectedFailure
from goodput.resilience.signals import HELPER_ENV
from goodput.storage.remote import Storage

# BatchNorm and dropout (helpers.StochasticNet), commits at 4, 8, 12 (experiment=smoke)
NET = ["model._target_=helpers.StochasticNet.build", "model.width=8"]


def test_rescue_dirs_parse_and_sort_after_the_regular_commit_of_their_step():
    assert parse_step("step-000000073.rescue") == 73 and is_rescue("step-000000073.rescue")
    for bad in (
        "step-73.rescue",
        "step-000000073.rescue.x",
        "step-000000073-rescue",
        "step-000000073.Rescue",
    ):
        assert parse_step(bad) is None and not is_rescue(bad)
    names = ["step-000000050", "step-000000073.rescue", "step-000000073", "step-000000100.rescue"]
    assert newest_first(names) == ["step-000000100.rescue", "step-000000073", "step-000000073.rescue",
                                   "step-000000050"]  # fmt: skip


def test_one_writer_wins_an_exclusive_create(tmp_path):
    store = Storage(str(tmp_path / "store"))
    wins = []

    def claim(i):
        wins.append(store.create_exclusive("step-000000007.rescue/claims/0.json", f"rank {i}".encode()))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(wins) == [False] * 7 + [True]
    winner = store.read_bytes("step-000000007.rescue/claims/0.json")
    assert winner.startswith(b"rank ")
    assert os.listdir(tmp_path / "store/step-000000007.rescue/claims") == ["0.json"]  # no temp file left


def test_an_exclusive_create_on_s3_is_a_conditional_put(s3_bucket):
    store = Storage(f"s3://{s3_bucket}/ckpt")
    assert store.create_exclusive("claims/0.json", b"a")
    assert not store.create_exclusive("claims/0.json", b"b")
    assert store.read_bytes("claims/0.json") == b"a"


def test_an_own_error_rescues_the_step_before_and_the_relaunch_is_exact(tmp_path, one_process):
    ref, _ = run_job_here(tmp_path / "ref", *NET)
    with pytest.raises(InjectedFailure):
        run_job_here(tmp_path / "a", *NET, "fault.raise_at_step=7")
    # the loop's mark for its helpers is gone with it: a job launched next from this process would
    # pass it to its forkserver, and its ranks would never see a preemption signal (CI saw that)
    assert HELPER_ENV not in os.environ
    d = ckpt_dir(tmp_path / "a")
    rec = Commits(Storage(str(d))).committed()[0]
    assert rec["dir"] == "step-000000006.rescue" and rec["kind"] == "rescue" and rec["rescued_by"] == [0]
    assert rec["regular_step"] == 4
    s, _ = run_job_here(tmp_path / "a", *NET, "fault.raise_at_step=7")
    assert s["resumed_from_steps"] == [6]
    assert s["model_sha256"] == ref["model_sha256"]  # BatchNorm statistics and dropout put back
    assert s["sample_order_sha256"] == ref["sample_order_sha256"]  # the loader's position too
    assert s["rescues"]["count"] == 1 and s["rescues"]["steps_saved"] == 2
    assert s["recovery"]["per_restart"] == [] or all(
        r["lost_steps"] <= 1 for r in s["recovery"]["per_restart"]
    )
    # off: the failure costs the steps since the last commit
    with pytest.raises(InjectedFailure):
        run_job_here(tmp_path / "b", *NET, "fault.raise_at_step=7", "checkpoint.rescue=false")
    s, _ = run_job_here(tmp_path / "b", *NET, "fault.raise_at_step=7", "checkpoint.rescue=false")
    assert s["resumed_from_steps"] == [4] and s["model_sha256"] == ref["model_sha256"]


def test_a_rescue_without_the_boundarys_buffers_would_be_caught(tmp_path, one_process, monkeypatch):
    """The negative control of the test above: a rescue that writes the live BatchNorm statistics
    (changed by the failed step's forward) resumes to another model."""
    ref, _ = run_job_here(tmp_path / "ref", *NET)
    monkeypatch.setattr(rescue_mod.Rescue, "boundary", _boundary_without_buffers)
    with pytest.raises(InjectedFailure):
        run_job_here(tmp_path / "a", *NET, "fault.raise_at_step=7")
    s, _ = run_job_here(tmp_path / "a", *NET, "fault.raise_at_step=7")
    assert s["resumed_from_steps"] == [6] and s["model_sha256"] != ref["model_sha256"]


_BOUNDARY = rescue_mod.Rescue.boundary


def _boundary_without_buffers(self, step, evaluated=True, stop_reason=None):
    _BOUNDARY(self, step, evaluated, stop_reason)
    self._buffers = {}  # nothing noted: the live statistics are written


# evaluations at 3, 6, 9, 12; val/loss never improves by 10 after the first: early stopping at 9
EVALS = ["trainer.eval_every_n_steps=3", "trainer.early_stopping_by=val/loss",
         "trainer.early_stopping_patience=2", "trainer.early_stopping_min_delta=10",
         "checkpoint.keep_best_by=val/loss", "checkpoint.keep_best_mode=min"]  # fmt: skip


def test_a_failure_inside_an_evaluation_rescues_its_step_and_the_relaunch_evaluates_it_first(
    tmp_path, one_process, monkeypatch
):
    """The step's update is done when its evaluation fails: the rescue writes that step, marked
    `evaluate_first`, and the relaunch evaluates it before its next step. Skipping that evaluation
    would leave the early-stopping counter one short: the run would stop three steps later."""
    from goodput.run import loop

    ref, _ = run_job_here(tmp_path / "ref", *NET, *EVALS)
    assert ref["steps"] == 9 and ref["stop_reason"] == "early_stopping"
    calls, real = [], loop.evaluate

    def fails_at_step_6(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("evaluation failed")
        return real(*a, **kw)

    monkeypatch.setattr(loop, "evaluate", fails_at_step_6)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        run_job_here(tmp_path / "a", *NET, *EVALS)
    rec = Commits(Storage(str(ckpt_dir(tmp_path / "a")))).committed()[0]
    assert rec["dir"] == "step-000000006.rescue" and rec["evaluate_first"] is True
    monkeypatch.setattr(loop, "evaluate", real)
    s, _ = run_job_here(tmp_path / "a", *NET, *EVALS)
    assert s["resumed_from_steps"] == [6]
    for k in ("steps", "stop_reason", "model_sha256", "val", "best_step", "best_value"):
        assert s[k] == ref[k], k


def test_a_failed_final_evaluation_is_not_the_end_of_the_run(tmp_path, one_process, monkeypatch):
    """The last step's evaluation fails: its rescue (step 12, `evaluate_first`) is the newest commit.
    A fresh launch must not call the run complete: it evaluates step 12, makes the final regular
    commit and writes the summary of the uninterrupted run."""
    from goodput.run import loop

    ref, _ = run_job_here(tmp_path / "ref", *NET)
    real = loop.evaluate

    def fails(*a, **kw):
        raise RuntimeError("final evaluation failed")

    monkeypatch.setattr(loop, "evaluate", fails)
    with pytest.raises(RuntimeError, match="final evaluation failed"):
        run_job_here(tmp_path / "a", *NET)
    store = Storage(str(ckpt_dir(tmp_path / "a")))
    rec = Commits(store).committed()[0]
    assert rec["dir"] == "step-000000012.rescue" and rec["evaluate_first"] is True
    monkeypatch.setattr(loop, "evaluate", real)
    s, _ = run_job_here(tmp_path / "a", *NET)
    assert s is not None and s["resumed_from_steps"] == [12]
    for k in ("steps", "model_sha256", "sample_order_sha256", "val_accuracy", "val"):
        assert s[k] == ref[k], k
    newest = Commits(store).committed()[0]
    assert newest["dir"] == "step-000000012" and newest.get("kind", "regular") == "regular"


def test_a_failed_final_save_after_early_stopping_is_finished_by_the_relaunch(
    tmp_path, one_process, monkeypatch
):
    """Early stopping decides at step 9 and the final save fails: the rescue of step 9 carries the
    evaluation, the counters and `stop_reason`. The relaunch evaluates again for the summary only
    (the early-stopping counter and the best are not counted twice), makes the final regular commit,
    and only then is the run complete."""
    from goodput.checkpoint.manager import CheckpointManager
    from goodput.run.job import AlreadyDone

    ref, _ = run_job_here(tmp_path / "ref", *NET, *EVALS)
    assert ref["steps"] == 9 and ref["stop_reason"] == "early_stopping"
    real = CheckpointManager.maybe_save

    def final_fails(self, step, app, last=False, info=None):
        if last:
            raise RuntimeError("final save failed")
        return real(self, step, app, last=last, info=info)

    monkeypatch.setattr(CheckpointManager, "maybe_save", final_fails)
    with pytest.raises(RuntimeError, match="final save failed"):
        run_job_here(tmp_path / "a", *NET, *EVALS)
    store = Storage(str(ckpt_dir(tmp_path / "a")))
    rec = Commits(store).committed()[0]
    assert rec["dir"] == "step-000000009.rescue" and rec["stop_reason"] == "early_stopping"
    assert not rec.get("evaluate_first")
    monkeypatch.setattr(CheckpointManager, "maybe_save", real)
    s, _ = run_job_here(tmp_path / "a", *NET, *EVALS)
    assert s is not None and s["resumed_from_steps"] == [9]
    for k in ("steps", "stop_reason", "model_sha256", "val_accuracy", "val", "best_step", "best_value"):
        assert s[k] == ref[k], k
    newest = Commits(store).committed()[0]
    assert newest["dir"] == "step-000000009" and newest["stop_reason"] == "early_stopping"
    with pytest.raises(AlreadyDone, match="stopped at step 9"):
        run_job_here(tmp_path / "a", *NET, *EVALS)


def test_a_rescue_that_runs_out_of_time_is_never_loaded(tmp_path, one_process, monkeypatch):
    slow_put = rescue_mod._put

    def put(*a):
        import time

        time.sleep(3)
        return slow_put(*a)

    monkeypatch.setattr(rescue_mod, "_put", put)
    with pytest.raises(InjectedFailure):
        run_job_here(tmp_path, *NET, "fault.raise_at_step=7", "checkpoint.rescue_timeout_s=1")
    records = Rescues(Storage(str(ckpt_dir(tmp_path)))).records()
    assert [r["outcome"] for r in records] == ["timed_out"]
    monkeypatch.setattr(rescue_mod, "_put", slow_put)
    s, _ = run_job_here(tmp_path, *NET, "fault.raise_at_step=7")
    assert s["resumed_from_steps"] == [4] and s["rescues"]["failures"] == 1


def _rescuer(tmp_path, timeout_s: float = 5.0):
    """Rank 0 of 2 under ddp's Rescue over make_app's state, at the boundary of step 3."""
    from goodput.parallel import DDP

    app, _, _ = make_app(0)
    store = Storage(str(tmp_path / "ckpt"))
    r = rescue_mod.Rescue(True, timeout_s, store, str(tmp_path / "staging"), 0, 2, DDP(), app,
                          app.rank_parts["rng"], app.model, lambda: {})  # fmt: skip
    app.register("data", _Position())
    r.boundary(3)
    return r, store


def test_inside_the_update_nothing_is_written(tmp_path):
    r, store = _rescuer(tmp_path)
    r.boundary(4)
    r.updating()
    out = r.write("a peer died")
    assert out["outcome"] == "in_update" and out["step"] is None
    assert not [n for n in store.ls() if parse_step(n) is not None]


def test_a_failure_inside_the_optimizers_step_writes_no_rescue(tmp_path, one_process, monkeypatch):
    """The optimizer of the job (one of the test's own, by `_target_`) writes one parameter of step 7
    and raises: the parameters are no step's. No rescue is written, whatever the optimizer: the mark
    is where `optimizer.step()` starts (StepGuard's pre-hook), not where the loop thinks it is. The
    relaunch resumes the regular step-4 commit and ends on the uninterrupted run's model."""
    from helpers import FailsInsideUpdate

    mine = [*NET, "optim.optimizer._target_=helpers.FailsInsideUpdate"]
    ref, _ = run_job_here(tmp_path, *mine, "run.name=ref")  # one paths.root: one demo data, one store
    monkeypatch.setattr(FailsInsideUpdate, "fail_at", 7)
    with pytest.raises(RuntimeError, match="failed inside its step 7, one parameter written"):
        run_job_here(tmp_path, *mine, "run.name=a")
    store = Storage(str(ckpt_dir(tmp_path, "a")))
    assert [r["dir"] for r in Commits(store).committed()] == ["step-000000004"]
    records = Rescues(store).records()
    assert [(r["outcome"], r["step"], r["reached"]) for r in records] == [("in_update", None, 6)]
    monkeypatch.setattr(FailsInsideUpdate, "fail_at", None)
    s, _ = run_job_here(tmp_path, *mine, "run.name=a")
    assert s["resumed_from_steps"] == [4] and s["model_sha256"] == ref["model_sha256"]


def test_a_main_thread_stuck_inside_a_boundary_does_not_hold_the_watchdog(tmp_path):
    """The main thread holds the rescue's lock while it notes a boundary (a clone of the buffers, a
    scaler's .item(): device work). A device wedged there must not block the watchdog's rescue,
    which has to return within its bound so the process ends and restarts."""
    r, store = _rescuer(tmp_path, timeout_s=0.5)
    r._lock.acquire()  # the main thread, stuck inside its next boundary
    box = {}
    th = threading.Thread(target=lambda: box.update(r.request("hung", handoff_s=0.0)), daemon=True)
    th.start()
    th.join(timeout=10)
    assert not th.is_alive(), "the watchdog's rescue waited for the stuck main thread"
    assert box["outcome"] == "timed_out" and box["step"] is None
    assert not [n for n in store.ls() if parse_step(n) is not None]


class _Position:
    def state_dict(self):
        return {"step": 0}

    def load_state_dict(self, sd):
        pass


def _rescue_commit(tmp_path, d, n_shards=1, step=6):
    """A real rescue of make_app's state: shard 0 of `n_shards` (no collective), as one survivor
    writes it. Returns the checkpoint dir's Storage."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    app, _, _ = make_app(0)
    mgr = manager(tmp_path, "dcp_sync", d)
    store = mgr.storage
    out = write_shard(store, str(tmp_path / "staging"), step, 0, n_shards, 0, 2,
                      app.state_dict(StateDictOptions()), lambda: mgr.fields(app))  # fmt: skip
    return store, out


def test_a_writer_that_fails_before_publishing_gives_its_claim_back(tmp_path, dist1):
    """Rank 0 claims the rescue and its node-local disk fails (here its staging dir is a file):
    rank 1, whose failure comes later (its collective fails once rank 0 has exited), can still
    write and commit the part from its own node."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    app, _, _ = make_app(0)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    store, sd = mgr.storage, app.state_dict(StateDictOptions())
    broken = tmp_path / "node0-staging"
    broken.write_text("not a dir")
    with pytest.raises(OSError):
        write_shard(store, str(broken), 6, 0, 1, 0, 2, sd, lambda: mgr.fields(app))
    out = write_shard(store, str(tmp_path / "node1-staging"), 6, 0, 1, 1, 2, sd, lambda: mgr.fields(app))
    assert out == {"outcome": "committed"}
    rec = Commits(store).committed()[0]
    assert rec["dir"] == "step-000000006.rescue" and rec["rescued_by"] == [1]
    assert Commits(store).verify(rec, local=False) is None


@pytest.mark.parametrize("local_copy", ["intact", "tampered"])
def test_a_rescue_commits_and_restores_like_any_commit(tmp_path, dist1, caplog, local_copy):
    """Restored on the writer's node from its staging copy, verified; a copy that does not verify
    is read from the store instead."""
    store, out = _rescue_commit(tmp_path, dist1)
    assert out == {"outcome": "committed"}
    rec = Commits(store).committed()[0]
    assert rec["dir"] == "step-000000006.rescue" and Commits(store).verify(rec, local=False) is None
    data = sorted(f for f in rec["files"] if f.endswith(".distcp"))[0]
    if local_copy == "tampered":
        staged = tmp_path / "staging" / rec["dir"] / data
        staged.write_bytes(b"\0" * staged.stat().st_size)  # the size matches, the checksum does not
    app, counter, _ = make_app(1)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    caplog.set_level("INFO", "goodput")
    got, skipped = mgr.restore(app, [rec])
    ref, ref_counter, _ = make_app(0)
    assert got["step"] == 6 and not skipped and counter.n == ref_counter.n == 0
    for (k, a), b in zip(app.model.state_dict().items(), ref.model.state_dict().values()):
        assert torch.equal(a, b), k
    n = len(rec["files"])
    if local_copy == "intact":
        assert f"step-000000006.rescue: all {n} files from the node-local copy (verified)" in caplog.text
    else:
        assert f"{n - 1} file(s) from the node-local copy, 1 from the remote" in caplog.text
    # a second survivor finds it committed and writes nothing
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    again = write_shard(store, str(tmp_path / "staging2"), 6, 0, 1, 1, 2, app.state_dict(StateDictOptions()),
                        lambda: {})  # fmt: skip
    assert again == {"outcome": "already_committed"}


class _Overlaps:
    """A store whose calls in each named group wait for each other (a barrier of the group's size):
    calls made one after another never meet, and the rescue fails with BrokenBarrierError."""

    def __init__(self, inner, groups: dict[str, list[tuple[str, str]]]):
        self.inner, self.calls, self._lock = inner, [], threading.Lock()
        self.groups = {g: (set(m), threading.Barrier(len(m), timeout=10)) for g, m in groups.items()}

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args, **kw):
            rel = args[-1] if name == "put" else (args[0] if args else "")
            with self._lock:
                self.calls.append((name, rel))
            for members, barrier in self.groups.values():
                if (name, rel) in members:
                    members.discard((name, rel))
                    barrier.wait()
            return fn(*args, **kw)

        return call


def test_a_single_shard_rescue_overlaps_its_round_trips_and_reads_nothing_back(tmp_path, dist1):
    """The restart waits for the survivor's rescue, and each store round trip of it is tens of ms on
    an object store: the two checks for a commit of the step go out together, so do the shard's
    uploads, and the commit's search for the newest regular commit runs beside the .metadata upload.
    The manifest and metadata of the committing rank's own shard are not read back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    app, _, _ = make_app(0)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    mgr.save(4, app)
    mgr.wait()
    rel = step_dir(6, rescue=True)
    store = _Overlaps(mgr.storage, {
        "checks": [("exists", f"{step_dir(6)}/{COMMIT}"), ("exists", f"{rel}/{COMMIT}")],
        "shard": [("put", f"{rel}/__0_0.distcp"), ("put", f"{rel}/rescue-0.metadata")],
        "commit": [("put", f"{rel}/.metadata"), ("ls", "")],
    })  # fmt: skip
    out = write_shard(store, str(tmp_path / "staging"), 6, 0, 1, 0, 2, app.state_dict(StateDictOptions()),
                      lambda: mgr.fields(app))  # fmt: skip
    assert out == {"outcome": "committed"}
    assert all(not members for members, _ in store.groups.values())  # every group met
    assert [c for c in store.calls if c[0] in ("read_bytes", "get") or c == ("ls", f"{rel}/ranks")] == []
    io = [c for c in store.calls if c[0] != "url"]  # 11 round trips, 3 pairs of them at once: 8 in a row
    assert len(io) == 11, io  # (docs/checkpointing.md: "Its round trips")
    rec = Commits(mgr.storage).committed()[0]
    assert rec["dir"] == rel and rec["regular_step"] == 4
    assert Commits(mgr.storage).verify(rec, local=False) is None


HANGS_AT_EXIT = """
import threading
from goodput.checkpoint.rescue import write_shard

entered = threading.Semaphore(0)

class Hangs:  # a store whose every call hangs
    def exists(self, rel):
        entered.release()
        threading.Event().wait()

args = (Hangs(), "unused", 6, 0, 1, 0, 1, {}, dict)
threading.Thread(target=write_shard, args=args, daemon=True).start()  # as Rescue.write runs it
assert entered.acquire(timeout=30) and entered.acquire(timeout=30)  # both commit checks are out
print("given up", flush=True)
"""


def test_a_process_exits_with_a_rescues_store_call_still_hanging():
    """The rescue gives up on a store that hangs at its deadline, and the process then exits: no
    thread it started for its round trips is joined at exit (a ThreadPoolExecutor's would be)."""
    p = subprocess.run([sys.executable, "-c", HANGS_AT_EXIT], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "given up\n", p.stderr[-2000:]


def test_a_rescue_missing_a_shard_is_never_committed_nor_loaded(tmp_path, dist1):
    """fsdp's one copy is spread over its ranks: a rescue with one of two shards written (the other
    rank died) stays uncommitted, and the next start removes it."""
    store, out = _rescue_commit(tmp_path, dist1, n_shards=2)
    assert out == {"outcome": "written"}
    assert not store.exists(f"{step_dir(6, rescue=True)}/{COMMIT}") and Commits(store).committed() == []
    manager(tmp_path, "dcp_sync", dist1).clean_incomplete()
    assert not store.exists(step_dir(6, rescue=True))


# every file a one-shard rescue writes to the store, in order: the claim, the data, the shard's
# metadata and manifest, the commit claim, the merged metadata, the commit record
@pytest.mark.parametrize("where", ["claims/0.json", ".distcp", "rescue-0.metadata", "rescue-0.json",
                                   "claims/commit.json", "/.metadata", "COMMIT.json"])  # fmt: skip
def test_a_rescue_killed_mid_write_is_never_loaded(tmp_path, dist1, where):
    from midwrite import kill_inside_the_write
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, _, _ = make_app(0)
    mgr.save(4, app)
    mgr.wait()
    remote = str(tmp_path / "remote")
    sd = app.state_dict(StateDictOptions())  # here: torch in a forked child may wait on a dead thread

    def rescue():
        write_shard(Storage(remote), str(tmp_path / "staging"), 6, 0, 1, 0, 2, sd, lambda: mgr.fields(app))

    kill_inside_the_write(rescue, remote, where=where)
    assert os.path.isdir(os.path.join(remote, step_dir(6, rescue=True)))  # it got as far as the store
    assert [r["step"] for r in Commits(Storage(remote)).committed()] == [4]
    other, _, _ = make_app(1)
    rec, skipped = manager(tmp_path, "dcp_sync", dist1).restore(other, Commits(Storage(remote)).committed())
    assert rec["step"] == 4 and not skipped


@pytest.mark.parametrize(
    "change, why",
    [
        ({"kind": "regular"}, "kind 'regular' does not match"),
        ({"kind": "urgent"}, "kind 'urgent' does not match"),
        ({"rescued_by": []}, "bad rescued_by"),
        ({"rescued_by": [2]}, "bad rescued_by"),
        ({"rescued_by": ["0"]}, "bad rescued_by"),
        ({"rescued_by": None}, "bad rescued_by"),
        ({"regular_step": 6}, "bad regular_step"),
        ({"regular_step": -1}, "bad regular_step"),
        ({"regular_step": "4"}, "bad regular_step"),
        ({"time": "x"}, "bad time"),  # a restart compares it with the hang markers' times
        ({"time": float("nan")}, "bad time"),
        ({"time": True}, "bad time"),
    ],
)
def test_a_malformed_rescue_commit_is_refused_naming_the_file(tmp_path, dist1, caplog, change, why):
    store, _ = _rescue_commit(tmp_path, dist1)
    rel = f"{step_dir(6, rescue=True)}/{COMMIT}"
    rec = json.loads(store.read_bytes(rel))
    store.write_bytes(rel, json.dumps({**rec, **change}).encode())
    assert Commits(store).committed() == []
    assert f"skipping {store.url(rel)}: {why}" in caplog.text


def test_a_regular_commit_in_a_rescue_dir_and_a_rescue_in_a_regular_dir_are_refused(tmp_path, dist1, caplog):
    store, _ = _rescue_commit(tmp_path, dist1)
    store.mv(step_dir(6, rescue=True), step_dir(6))
    assert Commits(store).committed() == []
    assert "kind 'rescue' does not match the directory step-000000006" in caplog.text


_FILE = {"bytes": 1, "xxh3_128": "0" * 32}
_SHARD1 = {"rank": 1, "shard": 1, "files": {"rescue-1.metadata": _FILE}, "evaluated": True}


@pytest.mark.parametrize(
    "manifest, why",
    [
        (b"{", "rescue-1.json"),
        (b'{"rank": 0, "shard": 0, "files": {}}', "'shard' is 0, the file name says 1"),
        (json.dumps({**_SHARD1, "rank": -1}).encode(), "'rank' is -1"),
        (json.dumps({**_SHARD1, "files": {"../x": _FILE}}).encode(), "../x"),
        (json.dumps({**_SHARD1, "files": {"__1_0.distcp": _FILE}}).encode(), "lists no rescue-1.metadata"),
        (json.dumps({**_SHARD1, "evaluated": "yes"}).encode(), "'evaluated' is 'yes'"),
        (json.dumps({k: v for k, v in _SHARD1.items() if k != "evaluated"}).encode(), "no 'evaluated'"),
        (json.dumps({**_SHARD1, "rank": 7}).encode(), "not below world size 2"),
    ],
)
def test_a_malformed_shard_manifest_stops_the_commit_naming_it(tmp_path, dist1, manifest, why):
    """The committing rank reads the other shards' manifests: each is untrusted input."""
    store, out = _rescue_commit(tmp_path, dist1, n_shards=2)
    rel = step_dir(6, rescue=True)
    store.write_bytes(f"{rel}/ranks/rescue-1.json", manifest)
    with pytest.raises(ValueError, match="rescue-1") as e:
        rescue_mod.commit(store, str(tmp_path / "staging" / rel), rel, 6, 2, 2, {})
    assert why in str(e.value)
    assert not store.exists(f"{rel}/{COMMIT}")


def test_merged_metadata_refuses_shards_that_do_not_cover_a_tensor():
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from goodput.checkpoint.backends import CheckpointLoadError

    def shard(offset, size=(4, 2)):
        chunk = ChunkStorageMetadata(torch.Size([offset, 0]), torch.Size([size[0] // 2, 2]))
        t = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), [chunk])
        return Metadata(
            {"model.w": t}, storage_data={MetadataIndex("model.w", [offset, 0]): f"__{offset}_0.distcp"}
        )

    merged = merge_metadata([shard(0), shard(2), shard(2)])  # a replica's copy of shard 1 kept once
    assert len(merged.state_dict_metadata["model.w"].chunks) == 2 and len(merged.storage_data) == 2
    with pytest.raises(CheckpointLoadError, match="cover 4 of 8 elements of model.w"):
        merge_metadata([shard(0)])
    with pytest.raises(CheckpointLoadError, match="disagree on model.w"):
        merge_metadata([shard(0), shard(2, size=(4, 3))])


GOOD_RECORD = {"attempt": 0, "rank": 0, "time": 1.0, "reached": 3, "step": 3, "outcome": "committed",
               "seconds": 1}  # fmt: skip


@pytest.mark.parametrize(
    "name, data",
    [
        ("attempt0000-rank0.json", b"[1]"),
        (
            "attempt0000-rank0.json",
            b'{"attempt": 0, "rank": 0, "time": 1.0, "reached": 3, "step": 3,'
            b' "outcome": "committed", "seconds": -1}',
        ),
        (
            "attempt0000-rank0.json",
            b'{"attempt": 0, "rank": 0, "time": 1.0, "reached": "3", "step": 3,'
            b' "outcome": "committed", "seconds": 1}',
        ),
        (
            "attempt0001-rank0.json",
            b'{"attempt": 0, "rank": 0, "time": 1.0, "reached": 3, "step": 3,'
            b' "outcome": "committed", "seconds": 1}',
        ),
    ]
    + [("attempt0000-rank0.json", json.dumps({**GOOD_RECORD, **change}).encode()) for change in (
        {"rank": 1},  # not the file's
        {"outcome": "exploded"},  # summarize_rescues would count it nowhere
        {"outcome": 1},
        {"step": -1},
        {"step": "3"},
        {"time": "yesterday"},
        {"seconds": float("nan")},
        {"attempt": True},
    )]
    + [("attempt0000-rank0.json", json.dumps({k: v for k, v in GOOD_RECORD.items() if k != gone}).encode())
       for gone in ("outcome", "seconds", "reached")],
)  # fmt: skip
def test_a_malformed_rescue_record_is_moved_aside_naming_it(tmp_path, caplog, name, data):
    store = Storage(str(tmp_path))
    store.write_bytes(f"rescues/{name}", data)
    assert Rescues(store).records() == []
    assert f"rescues/{name}" in caplog.text
    assert not store.exists(f"rescues/{name}")  # moved aside, kept under another name


def test_every_outcome_a_rescue_records_is_read_back(tmp_path):
    """The control of the test above: each outcome Rescue writes (and step null: nothing to write) passes."""
    store = Storage(str(tmp_path))
    for i, outcome in enumerate(rescue_mod.OUTCOMES):
        step = None if outcome == "nothing_new" else 3
        rec = {**GOOD_RECORD, "attempt": i, "outcome": outcome, "step": step}
        store.write_bytes(f"rescues/attempt{i:04d}-rank0.json", json.dumps(rec).encode())
    assert [r["outcome"] for r in Rescues(store).records()] == list(rescue_mod.OUTCOMES)


def test_a_ranks_streams_at_a_boundary_are_known_without_its_state():
    """RNGState.derived(rank, step) is what at_step(step) leaves on that rank: a rescue speaks for
    ranks it cannot ask, and a rank the checkpoint did not have starts where it would have been."""
    import random

    import numpy as np

    from goodput.checkpoint.state import RNGState

    other = RNGState(seed=7, rank=0).derived(rank=3, step=11)
    three = RNGState(seed=7, rank=3)
    torch.rand(5), np.random.rand(3), random.random()  # anywhere before
    three.at_step(11)
    assert three.state_dict() == other
    draws = (torch.rand(3), np.random.rand(2), random.random())
    three.load_state_dict(other)
    assert torch.equal(torch.rand(3), draws[0]) and (np.random.rand(2) == draws[1]).all()
    assert random.random() == draws[2]
    assert RNGState(7, 0).derived(3, 12) != other and RNGState(7, 0).derived(2, 11) != other


def _own_streams(seed: int, rank: int, step: int) -> dict:
    """What `rank`'s own RNGState holds at the boundary after `step` (its at_step run here, this
    process's streams put back after), as a checkpoint's per-rank entry reads back."""
    import random

    import numpy as np

    from goodput.checkpoint.state import RNGState

    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        streams = RNGState(seed, rank)
        streams.at_step(step)
        sd = streams.state_dict()
    np.random.set_state(np_state)
    random.setstate(py_state)
    return json.loads(json.dumps(sd))


def test_a_two_rank_rescue_writes_each_ranks_own_random_streams(tmp_path):
    """Under ddp one survivor writes the rescue for both ranks: rank 1's entry must be rank 1's
    streams at the boundary, not a copy of the writer's (every stream is reseeded at the next step
    today, but a checkpoint says where each rank's streams stood, and a resume sets them)."""
    import torch.distributed.checkpoint as dcp

    from goodput.checkpoint.backends import SafeFileSystemReader
    from goodput.checkpoint.state import decode

    app, _, _ = make_app(0)  # the writer is rank 0 of seed 0
    app.register("data", _Position())
    r = _rescue_of(app, tmp_path, world=2)
    r.boundary(3)
    r.boundary(5)
    assert r.write("rank 1 died")["outcome"] == "committed"
    rec = Commits(Storage(str(tmp_path / "ckpt"))).committed()[0]
    reader = SafeFileSystemReader(str(tmp_path / "ckpt" / rec["dir"]))
    md = reader.read_metadata().state_dict_metadata
    entries = {k: torch.empty(md[k].size, dtype=torch.uint8) for k in md if k.startswith("rank")}
    assert sorted(entries) == ["rank0.rng", "rank1.rng"]
    dcp.load(entries, storage_reader=reader, no_dist=True)
    got = {k: decode(v) for k, v in entries.items()}
    assert got["rank0.rng"] == _own_streams(0, 0, 5)
    assert got["rank1.rng"] == _own_streams(0, 1, 5) != got["rank0.rng"]


def _rescue_of(app, tmp_path, world=2, strategy=None, timeout_s=10.0):
    from goodput.parallel import DDP

    store, staging = Storage(str(tmp_path / "ckpt")), str(tmp_path / "staging")
    return rescue_mod.Rescue(True, timeout_s, store, staging, 0, world, strategy or DDP(), app,
                             app.rank_parts["rng"], app.model, lambda: {})  # fmt: skip


def test_a_rescue_asked_for_by_another_thread_is_written_by_the_main_thread_at_its_next_boundary(tmp_path):
    """The grace timer fires while the main thread is slow, not stuck: the main thread must not
    change the state under the writer. It takes the rescue over at its next step boundary (here:
    step 5, a newer state than the step 4 noted when the request came) and then parks."""
    app, _, _ = make_app(0)
    app.register("data", _Position())
    r = _rescue_of(app, tmp_path)
    r.boundary(3)
    r.boundary(4)
    parked = threading.Event()

    class Parked(Exception):
        pass

    def park():
        parked.set()
        raise Parked  # in the job the main thread waits here for the requester to end the process

    r.park = park
    got = {}
    th = threading.Thread(target=lambda: got.update(r.request("no step boundary 10s after SIGTERM")))
    th.start()
    time.sleep(0.3)  # the main thread is still computing its step
    with torch.no_grad():
        for p in app.model.parameters():
            p.add_(1.0)  # step 5's update, as the optimizer would
    with pytest.raises(Parked):
        r.boundary(5)
    th.join(10)
    assert parked.is_set() and got["outcome"] == "committed" and got["step"] == 5
    rec = Commits(Storage(str(tmp_path / "ckpt"))).committed()[0]
    assert rec["step"] == 5 and rec["kind"] == "rescue"


def test_a_stuck_main_thread_is_rescued_by_the_requesting_thread(tmp_path, monkeypatch):
    app, _, _ = make_app(0)
    app.register("data", _Position())
    r = _rescue_of(app, tmp_path, timeout_s=3.0)  # the hand-over waits 1 s
    r.boundary(3)
    r.boundary(4)
    got = {}
    th = threading.Thread(target=lambda: got.update(r.request("hang watchdog")))
    th.start()
    th.join(10)  # the main thread never reaches a boundary
    assert got["outcome"] == "committed" and got["step"] == 4


def test_the_bound_counts_from_the_request_not_from_the_end_of_the_hand_over(tmp_path, monkeypatch):
    """The grace and the bound together fit before the agent's SIGKILL (checked at compose time):
    the hand-over wait (a third of the bound) must come out of the bound, not be added to it."""
    app, _, _ = make_app(0)
    app.register("data", _Position())
    r = _rescue_of(app, tmp_path, timeout_s=6.0)  # the hand-over waits 2 s
    r.boundary(3)
    r.boundary(4)
    monkeypatch.setattr(rescue_mod, "write_shard", lambda *a, **kw: time.sleep(30))  # a store that hangs
    got = {}
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: got.update(r.request("no step boundary after SIGTERM")))
    th.start()
    th.join(20)
    took = time.monotonic() - t0
    assert got["outcome"] == "timed_out" and 6.0 <= took < 7.5, took  # not 2 + 6


def _two_shard_writers(tmp_path, dist1):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    app, _, _ = make_app(0)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    mgr.save(4, app)
    mgr.wait()
    sd = app.state_dict(StateDictOptions())

    def write(shard, rank, **kw):
        return write_shard(mgr.storage, str(tmp_path / f"staging{rank}"), 6, shard, 2, rank, 2, sd,
                           lambda: mgr.fields(app), **kw)  # fmt: skip

    return mgr.storage, write


def test_shards_noted_before_and_after_the_steps_evaluation_are_never_committed_together(tmp_path, dist1):
    """A peer killed inside the evaluation's all-reduce: it can end on some ranks and not on
    others, so one shard's writer holds the run state before the evaluation (its counter, best and
    metrics not updated, `evaluate_first`) and the other's after. Together they are neither."""
    store, write = _two_shard_writers(tmp_path, dist1)
    assert write(0, 0, evaluated=False) == {"outcome": "written"}
    with pytest.raises(ValueError, match="noted before and after step 6's evaluation"):
        write(1, 1, evaluated=True)
    assert [r["step"] for r in Commits(store).committed()] == [4]


def test_shards_noted_at_the_same_point_commit(tmp_path, dist1):
    """The control of the test above."""
    store, write = _two_shard_writers(tmp_path, dist1)
    assert write(0, 0, evaluated=False) == {"outcome": "written"}
    assert write(1, 1, evaluated=False) == {"outcome": "committed"}
    assert [r["step"] for r in Commits(store).committed()] == [6, 4]


def test_a_shard_finished_past_the_bound_publishes_no_manifest(tmp_path, dist1, monkeypatch):
    """A manifest makes a shard count for another rank's commit: a writer past its bound (which
    has recorded `timed_out`) must not hand a shard to a peer whose bound is later."""
    store, write = _two_shard_writers(tmp_path, dist1)
    real = rescue_mod._put
    monkeypatch.setattr(rescue_mod, "_put", lambda *a: (time.sleep(1.5), real(*a))[1])
    with pytest.raises(TimeoutError):
        write(0, 0, deadline=time.monotonic() + 1.0)
    assert store.exists(step_dir(6, rescue=True) + "/rescue-0.metadata")  # its upload finished
    assert not store.exists(step_dir(6, rescue=True) + "/ranks/rescue-0.json")


def _ddp_rank_with_batchnorm(tmp_path, rank: int):
    """A Rescue of one DDP rank of 2 whose model has BatchNorm statistics of its own."""
    from helpers import StochasticNet

    from goodput.checkpoint import AppState, RNGState
    from goodput.parallel import DDP

    torch.manual_seed(rank)
    model = StochasticNet.build(num_classes=4)
    model(torch.randn(4, 3, 8, 8))  # the statistics differ by rank: each saw its own batch
    app = AppState(model, torch.optim.SGD(model.parameters(), lr=0.1), rank=rank)
    app.register("data", _Position())
    app.register("rng", RNGState(0, rank), per_rank=True)
    store, staging = Storage(str(tmp_path / "ckpt")), str(tmp_path / f"staging{rank}")
    r = rescue_mod.Rescue(True, 10.0, store, staging, rank, 2, DDP(), app, app.rank_parts["rng"], model,
                          lambda: {})  # fmt: skip
    r.boundary(3)
    r.boundary(4)
    return r, {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


def test_under_ddp_rank_0_writes_the_rescue_even_when_another_rank_gets_there_first(tmp_path):
    """The next step would have used rank 0's BatchNorm statistics (DDP broadcasts them): so
    rank 0's are the exact ones, and a higher rank holds back half a second before it claims."""
    r1, _ = _ddp_rank_with_batchnorm(tmp_path, 1)
    r0, stats0 = _ddp_rank_with_batchnorm(tmp_path, 0)
    got = {}
    first = threading.Thread(target=lambda: got.update({1: r1.write("a peer died")}))
    first.start()
    time.sleep(0.1)
    got[0] = r0.write("a peer died")
    first.join(20)
    assert (got[0]["outcome"], got[1]["outcome"]) == ("committed", "claimed_by_another")
    rec = Commits(Storage(str(tmp_path / "ckpt"))).committed()[0]
    assert rec["rescued_by"] == [0]
    import torch.distributed.checkpoint as dcp

    back = {f"model.{k}": torch.zeros_like(v) for k, v in stats0.items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "ckpt" / rec["dir"]), no_dist=True)
    for k, v in stats0.items():
        assert torch.equal(back[f"model.{k}"], v), k


def test_nothing_is_rescued_or_recorded_before_the_first_boundary(tmp_path):
    """A failure during a later attempt's restore: no boundary yet, no attempt number yet (writing
    a record would overwrite attempt 0's)."""
    app, _, _ = make_app(0)
    app.register("data", _Position())
    r = _rescue_of(app, tmp_path)
    assert r.write("the restore failed")["outcome"] == "not_started"
    assert Storage(str(tmp_path / "ckpt")).ls() == {}


def test_a_rescue_past_its_deadline_commits_nothing(tmp_path, dist1):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    app, _, _ = make_app(0)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    with pytest.raises(TimeoutError):
        write_shard(mgr.storage, str(tmp_path / "staging"), 6, 0, 1, 0, 2, app.state_dict(StateDictOptions()),
                    lambda: mgr.fields(app), deadline=0.0)  # fmt: skip
    assert Commits(mgr.storage).committed() == []


@pytest.mark.parametrize("slow", ["rescue-0.metadata", ".metadata"])  # the shard's upload; the merged one
def test_a_rescue_whose_upload_outlasts_its_deadline_commits_nothing(tmp_path, dist1, monkeypatch, slow):
    """The bound is checked again after the last upload, right before COMMIT.json: an upload that
    ran past it (a slow store) leaves the rescue uncommitted, so the relaunch does not wait on it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    app, _, _ = make_app(0)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    mgr.save(4, app)
    mgr.wait()
    real = rescue_mod._put

    def put(store, local, rel, name):
        if name == slow:
            time.sleep(1.5)
        return real(store, local, rel, name)

    monkeypatch.setattr(rescue_mod, "_put", put)
    with pytest.raises(TimeoutError):
        write_shard(mgr.storage, str(tmp_path / "staging"), 6, 0, 1, 0, 2, app.state_dict(StateDictOptions()),
                    lambda: mgr.fields(app), deadline=time.monotonic() + 1.0)  # fmt: skip
    assert mgr.storage.exists(step_dir(6, rescue=True) + "/" + slow)  # the upload itself finished
    assert [r["step"] for r in Commits(mgr.storage).committed()] == [4]


def test_the_rescue_of_an_early_stop_says_so(tmp_path):
    """Early stopping decided at step 5, then the final save failed: the relaunch must not train on."""
    app, _, _ = make_app(0)
    app.register("data", _Position())
    r = _rescue_of(app, tmp_path)
    r.boundary(3)
    r.boundary(5, evaluated=True, stop_reason="early_stopping")
    assert r.write("the save failed")["outcome"] == "committed"
    rec = Commits(Storage(str(tmp_path / "ckpt"))).committed()[0]
    assert rec["stop_reason"] == "early_stopping" and "evaluate_first" not in rec


def test_retention_removes_a_superseded_rescue_unless_it_is_the_best(tmp_path, dist1):
    store, _ = _rescue_commit(tmp_path, dist1, step=6)
    mgr = manager(tmp_path, "dcp_sync", dist1, keep_best_by="val/accuracy")
    app, _, _ = make_app(0)
    mgr.best.observe({"val/accuracy": 0.9}, 6)  # the rescue's step is the best so far
    mgr.save(8, app)
    mgr.wait()
    assert [r["dir"] for r in Commits(store).committed()] == ["step-000000008", "step-000000006.rescue"]
    mgr.best.observe({"val/accuracy": 0.95}, 8)
    mgr.save(10, app)
    mgr.wait()
    assert [r["dir"] for r in Commits(store).committed()] == ["step-000000010", "step-000000008"]


def test_the_summary_counts_a_rescue_resumed_twice_once():
    from goodput.resilience.accounting import summarize_rescues

    attempts = [
        {"attempt": 0, "resumed_from": None},
        {"attempt": 1, "resumed_from": 73, "resumed_kind": "rescue", "rescued_over": 50},
        {
            "attempt": 2,
            "resumed_from": 73,
            "resumed_kind": "rescue",
            "rescued_over": 50,
        },  # died before a commit
    ]
    records = [{"attempt": 0, "outcome": "committed", "seconds": 0.5},
               {"attempt": 1, "outcome": "nothing_new", "seconds": 0.0},
               {"attempt": 2, "outcome": "written", "seconds": 0.2}]  # fmt: skip
    s = summarize_rescues(attempts, records)
    assert (s["count"], s["steps_saved"], s["failures"]) == (1, 23, 1)


def test_a_rescue_that_committed_after_its_writer_gave_up_and_was_resumed_is_no_failure():
    """The writer's bound ran out while its COMMIT.json was on its way (a slow store): its record
    says timed_out, and the relaunch resumed the rescue all the same."""
    from goodput.resilience.accounting import summarize_rescues

    attempts = [{"attempt": 0, "resumed_from": None},
                {"attempt": 1, "resumed_from": 73, "resumed_kind": "rescue", "rescued_over": 50}]  # fmt: skip
    late = [{"attempt": 0, "step": 73, "outcome": "timed_out", "seconds": 15.0}]
    assert summarize_rescues(attempts, late)["failures"] == 0
    lost = [{"attempt": 0, "step": 74, "outcome": "timed_out", "seconds": 15.0}]  # another step's
    assert summarize_rescues(attempts, lost)["failures"] == 1


def test_the_grace_and_the_rescue_must_fit_before_the_agents_kill():
    from helpers import check_config_change, compose_train
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(compose_train(["experiment=smoke"]), resolve=True)
    check_config_change(c, {}, None)  # the defaults: 10 + 15 s
    check_config_change(
        c, {"checkpoint": {"rescue_timeout_s": 20.0}},
        "trainer.signal_grace_seconds=10 + checkpoint.rescue_timeout_s=20 must be at most 25",
    )  # fmt: skip
    check_config_change(c, {"checkpoint": {"rescue_timeout_s": 20.0, "rescue": False}}, None)  # off: no limit
    check_config_change(
        c, {"checkpoint": {"rescue_timeout_s": 30.0}}, "checkpoint.rescue_timeout_s must be in (0, 25]"
    )
