"""The run lock is exclusive, written the way a slow store delivers it: a job's write of LOCK.json
held back until the other job has taken and read back its own, two jobs taking over a stale lock at
once, and a holder whose lock was taken over (its heartbeat went stale) stopping before its next
commit. The records of the lock are checked as untrusted input in test_untrusted.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
from helpers import ckpt_dir, run_job_here

from goodput.checkpoint.commits import Commits
from goodput.errors import UserError
from goodput.resilience.lock import LockLost, RunLock, RunLocked, owns
from goodput.storage.remote import Storage


class HeldBack(Storage):
    """A store whose writes of the lock's files (LOCK.json, a takeover claim) reach it only once
    `go` is set: a slow PUT, a host descheduled between its look and its write. `sent` is set
    when the first such write is on its way."""

    def __init__(self, root: str, go: threading.Event):
        super().__init__(root)
        self.go, self.sent = go, threading.Event()

    def _held(self, rel: str) -> None:
        if rel == RunLock.NAME or rel.startswith("LOCK.takeover-"):
            self.sent.set()
            assert self.go.wait(30)

    def write_bytes(self, rel, data):
        self._held(rel)
        return super().write_bytes(rel, data)

    def create_exclusive(self, rel, data):
        self._held(rel)
        return super().create_exclusive(rel, data)


def lock_on(store: Storage, host: str, **kw) -> RunLock:
    """A job's lock, as if on `host` (this process holds several: on one host they would take each
    other for a restarted container with the same PID)."""
    lock = RunLock(store, **kw)
    lock.record["host"] = host
    return lock


def race(slow: RunLock, fast: RunLock, go: threading.Event) -> dict:
    """`slow` starts first, its write held back; `fast` takes the lock meanwhile; then the held write
    lands. Returns {"slow"|"fast": True (acquired) or the RunLocked}."""
    won = {}

    def take(lock, name):
        try:
            lock.acquire()
            won[name] = True
        except RunLocked as e:
            won[name] = e

    th = threading.Thread(target=take, args=(slow, "slow"))
    th.start()
    assert slow.storage.sent.wait(30)  # its write is on its way
    take(fast, "fast")
    go.set()
    th.join(60)
    assert not th.is_alive()
    return won


def holder(root) -> dict:
    return json.loads((root / RunLock.NAME).read_text())


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_write_that_lands_late_never_makes_a_second_holder(tmp_path, kind, request):
    """Before: both jobs wrote LOCK.json and read it back 50 ms later; the slow job's write landed
    after the fast job's read-back, and both trained in one checkpoint dir. Exactly one wins now,
    by link(2) on a local store and by a conditional PUT on S3."""
    root = str(tmp_path) if kind == "local" else f"s3://{request.getfixturevalue('s3_bucket')}/run"
    go, store = threading.Event(), Storage(root)
    slow = lock_on(HeldBack(root, go), "node-a")
    fast = lock_on(store, "node-b")
    won = race(slow, fast, go)
    assert won["fast"] is True, won
    assert isinstance(won["slow"], RunLocked) and "on node-b" in str(won["slow"]), won
    assert json.loads(store.read_bytes(RunLock.NAME))["token"] == fast.token
    slow.release()  # a job refused leaves the winner's lock alone
    assert json.loads(store.read_bytes(RunLock.NAME))["token"] == fast.token
    fast.release()
    assert not [n for n in store.ls() if owns(n)]  # nothing of the lock is left


def test_a_store_without_create_if_absent_says_the_lock_is_best_effort_once(caplog):
    for _ in range(2):
        lock = RunLock(Storage("memory://goodput-lock-test/run"))
        lock.acquire()
        lock.release()
    said = [r.getMessage() for r in caplog.records if "best effort" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the run lock of memory://goodput-lock-test/run"), said


def dead_lock(root, **fields) -> None:
    """LOCK.json of a job of the previous version (the heartbeat inside it), on another host."""
    t = time.time() - 3600
    rec = {"host": "node-gone", "pid": 4242, "token": "old", "started": t, "heartbeat": t, **fields}
    (root / RunLock.NAME).write_text(json.dumps(rec))


def test_a_stale_lock_taken_over_by_two_jobs_at_once_has_one_new_holder(tmp_path):
    """Both find the previous version's lock stale (its heartbeat an hour old); the slow one's claim
    lands after the fast one took over: it is refused, naming the new holder."""
    dead_lock(tmp_path)
    go = threading.Event()
    slow = lock_on(HeldBack(str(tmp_path), go), "node-a")
    fast = lock_on(Storage(str(tmp_path)), "node-b")
    won = race(slow, fast, go)
    assert won["fast"] is True and isinstance(won["slow"], RunLocked), won
    assert "on node-b" in str(won["slow"]), won
    assert holder(tmp_path)["token"] == fast.token
    fast.release()
    slow.release()
    assert not [p.name for p in tmp_path.iterdir() if owns(p.name)]


def test_a_takeover_claim_left_by_a_taker_that_died_is_taken_over(tmp_path):
    dead_lock(tmp_path)
    t = time.time() - 3600
    claim = {"host": "node-gone-too", "pid": 4243, "token": "taker", "started": t}
    (tmp_path / "LOCK.takeover-old").write_text(json.dumps(claim))
    lock = lock_on(Storage(str(tmp_path)), "node-a")
    lock.acquire()
    assert holder(tmp_path)["token"] == lock.token
    assert not (tmp_path / "LOCK.takeover-old").exists()
    lock.release()


def test_a_malformed_heartbeat_is_none_and_a_malformed_claim_no_ones(tmp_path, caplog):
    """The lock's other files are input too: a junk heartbeat does not keep a dead lock alive, a
    junk claim does not block the takeover (it is removed, with a warning naming it)."""
    dead_lock(tmp_path)
    (tmp_path / "LOCK.beat-old").write_text('{"heartbeat": "now"}')
    (tmp_path / "LOCK.takeover-old").write_text("[")
    lock = lock_on(Storage(str(tmp_path)), "node-a")
    lock.acquire()
    assert holder(tmp_path)["token"] == lock.token
    assert any("LOCK.takeover-old" in r.message and "removing it" in r.message for r in caplog.records)
    lock.release()
    assert not [p.name for p in tmp_path.iterdir() if owns(p.name)]


def test_the_heartbeat_inside_an_earlier_versions_lock_still_counts(tmp_path):
    dead_lock(tmp_path, heartbeat=time.time())  # started an hour ago, beating now: a live job
    with pytest.raises(RunLocked, match="pid 4242 on node-gone"):
        lock_on(Storage(str(tmp_path)), "node-a").acquire()


def test_a_holder_whose_lock_was_taken_over_marks_it_lost_and_stops_beating(tmp_path):
    store = Storage(str(tmp_path))
    a = lock_on(store, "node-a", heartbeat_seconds=0.05)
    a.acquire()
    b = lock_on(store, "node-b", stale_seconds=0.0)  # A's heartbeat looks stale to B (A was frozen)
    b.acquire()
    deadline = time.monotonic() + 10
    while a.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert a.lost is not None and "took over the run lock" in a.lost and "on node-b" in a.lost, a.lost
    time.sleep(0.2)  # several of A's heartbeat periods: it writes nothing for a lock not its own
    assert not (tmp_path / f"LOCK.beat-{a.token}").exists()
    a.release()
    assert holder(tmp_path)["token"] == b.token
    b.release()


@pytest.mark.parametrize("when", ["save", "upload"])
def test_a_job_that_lost_its_lock_stops_before_its_next_commit(tmp_path, one_process, monkeypatch, when):
    """Through the job: another job takes the run lock over at step 8 (this job's heartbeat looked
    stale to it), before its save starts or while its files upload. This job commits nothing more
    (before the save: it writes no step dir either, nor a rescue) and stops with one line naming the
    other holder."""
    from goodput.checkpoint.manager import CheckpointManager

    other = {}
    real = getattr(CheckpointManager, f"_{when}")

    def take_over(self, step, *a):
        if step == 8 and not other:
            other["lock"] = lock_on(Storage(self.storage.root), "node-b", stale_seconds=0.0)
            other["lock"].acquire()
        return real(self, step, *a)

    monkeypatch.setattr(CheckpointManager, f"_{when}", take_over)
    with pytest.raises(LockLost) as e:
        run_job_here(tmp_path)
    line = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in line  # scripts/train.py: one line, exit 2
    assert line.startswith("another job took over the run lock of ") and "on node-b" in line, line
    store = Storage(str(ckpt_dir(tmp_path)))
    assert [r["step"] for r in Commits(store).committed()] == [4]
    steps = sorted(n for n in store.ls() if n.startswith("step-"))
    assert steps == ["step-000000004"] if when == "save" else ["step-000000004", "step-000000008"]
    assert holder(ckpt_dir(tmp_path))["token"] == other["lock"].token  # its lock left alone
    other["lock"].release()


def test_a_rescue_after_the_lock_was_lost_commits_nothing(tmp_path, one_process, monkeypatch):
    """A step fails after another job took the lock over (before this job's next save noticed): the
    rescue of the last step is not committed into the other job's run."""
    from goodput.checkpoint.rescue import Rescue
    from goodput.resilience.fault import InjectedFailure

    real, other = Rescue.write, {}

    def write(self, *a, **kw):
        other["lock"] = lock_on(Storage(self.store.root), "node-b", stale_seconds=0.0)
        other["lock"].acquire()
        return real(self, *a, **kw)

    monkeypatch.setattr(Rescue, "write", write)
    with pytest.raises(InjectedFailure):
        run_job_here(tmp_path, "fault.raise_at_step=7")
    store = Storage(str(ckpt_dir(tmp_path)))
    assert [r["step"] for r in Commits(store).committed()] == [4]  # no step-000000006.rescue commit
    other["lock"].release()
