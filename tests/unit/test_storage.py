"""The storage layer: fsspec roots, emulated latency/bandwidth, atomic writes, retries."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from helpers import make_app, manager

from goodput.checkpoint.rescue import RECORDS
from goodput.resilience.accounting import Attempts, Rescues
from goodput.resilience.fault import Faults
from goodput.storage.checksum import file_digest
from goodput.storage.local import TEMP_PREFIX, atomic_file, atomic_write
from goodput.storage.remote import Storage, StorageConfig, StorageError, each


def test_local_roundtrip_and_listing(tmp_path):
    s = Storage(str(tmp_path / "r"))
    s.write_bytes("a/b.bin", b"x" * 10)
    src = tmp_path / "local.bin"
    src.write_bytes(b"y" * 5)
    t = s.put(str(src), "a/c.bin")
    assert t.size == 5 and t == file_digest(str(src))  # hashed while it streamed out
    assert s.ls("a") == {"b.bin": 10, "c.bin": 5}
    assert s.find("") == {"a/b.bin": 10, "a/c.bin": 5}
    assert s.get("a/b.bin", str(tmp_path / "out" / "b.bin")) == file_digest(
        str(tmp_path / "r" / "a" / "b.bin")
    )
    assert (tmp_path / "out" / "b.bin").read_bytes() == b"x" * 10
    assert not list((tmp_path / "r" / "a").glob(f"{TEMP_PREFIX}*"))  # no temp files left behind
    s.rm("a", recursive=True)
    assert s.ls("") == {}


def test_memory_root():
    s = Storage("memory://goodput-storage-test")
    s.write_bytes("k/v", b"123")
    assert s.read_bytes("k/v") == b"123" and s.exists("k/v")


def test_latency_and_bandwidth_are_emulated(tmp_path):
    fast = Storage(str(tmp_path))
    slow = Storage(str(tmp_path), StorageConfig(latency_ms=30, bandwidth_mb_s=1))
    fast.write_bytes("f", b"0" * 100_000)
    t0 = time.perf_counter()
    fast.read_bytes("f")
    t1 = time.perf_counter()
    slow.read_bytes("f")  # 30 ms + 100 kB at 1 MB/s = 0.13 s
    t2 = time.perf_counter()
    assert t2 - t1 >= 0.13 > t1 - t0


def test_transient_errors_are_retried(tmp_path):
    s = Storage(str(tmp_path), StorageConfig(error_rate=0.3, retries=30, backoff_s=0.001))
    for i in range(30):
        s.write_bytes(f"f{i}", b"ok")
    assert all(s.read_bytes(f"f{i}") == b"ok" for i in range(30))


def test_persistent_errors_name_the_file(tmp_path):
    s = Storage(str(tmp_path), StorageConfig(error_rate=0.999, retries=2, backoff_s=0.001))
    with pytest.raises(StorageError, match="f0"):
        s.write_bytes("f0", b"x")


def test_bad_config_and_protocol():
    with pytest.raises(ValueError, match="storage.latency_ms"):
        StorageConfig(latency_ms=-1)
    with pytest.raises(ValueError, match="unknown storage protocol 'bogus://'"):
        Storage("bogus://x")


# -- one atomic write -------------------------------------------------------------------------
def test_atomic_file_failure_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    atomic_write(str(p), "old")
    with pytest.raises(RuntimeError), atomic_file(str(p)) as f:
        f.write(b"new, half")
        raise RuntimeError("the writer failed midway")
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]

    def full(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)  # the rename itself fails
    with pytest.raises(OSError, match="No space"):
        atomic_write(str(p), b"new")
    monkeypatch.undo()
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]
    with pytest.raises(ValueError, match="mode"):
        atomic_file(str(p), "a").__enter__()
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(p).st_mode & 0o777 == 0o666 & ~umask  # as open() makes it (mkstemp: 0o600)


def test_readers_never_see_a_half_written_file(tmp_path):
    p, n = str(tmp_path / "big.bin"), 1 << 20
    old, new = b"a" * n, b"b" * n
    atomic_write(p, old)
    seen, writing, done = [], threading.Event(), threading.Event()

    def reader():
        while not done.is_set():
            with open(p, "rb") as f:
                data = f.read()
            seen.append((writing.is_set(), data in (old, new), len(data)))

    r = threading.Thread(target=reader)
    r.start()
    with atomic_file(p) as f:
        writing.set()
        for i in range(0, n, 1 << 14):  # 64 pieces with pauses: readers poll in between
            f.write(new[i : i + (1 << 14)])
            f.flush()
            time.sleep(0.002)
    done.set()
    r.join()
    assert all(whole for _, whole, _ in seen), [size for _, whole, size in seen if not whole][:5]
    assert sum(during for during, _, _ in seen) > 10  # the reader did poll while the write ran
    assert (tmp_path / "big.bin").read_bytes() == new


def test_concurrent_writers_get_their_own_temp_file(tmp_path):
    p = str(tmp_path / "same.bin")
    both_inside, temps, errors = threading.Barrier(2, timeout=10), [], []

    def write(byte: bytes):
        try:
            with atomic_file(p) as f:
                f.write(byte * 100_000)
                both_inside.wait()  # both temp files exist now
                temps.append(sorted(n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)))
                # and stay until both have looked: a writer that renamed first left the other
                # listing one temp file (CI on a busy machine)
                both_inside.wait()
                f.write(byte * 100_000)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=write, args=(b,)) for b in (b"x", b"y")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert all(len(names) == 2 for names in temps)  # two writers, two temp names
    # one whole file: the last one renamed
    assert (tmp_path / "same.bin").read_bytes() in (b"x" * 200_000, b"y" * 200_000)
    assert os.listdir(tmp_path) == ["same.bin"]


def test_a_file_being_written_is_not_listed_under_its_suffix(tmp_path):
    """Listings select by suffix (a rank's manifest `ranks/<r>.json`, attempt records, images): the
    temp name of a write in progress must not match them, or rank 0 commits before a rank's
    manifest exists."""
    store = Storage(str(tmp_path))
    with atomic_file(str(tmp_path / "ranks" / "1.json")) as f:
        f.write(b"{}")
        names = list(store.ls("ranks"))
        assert len(names) == 1 and not names[0].endswith(".json") and names[0].startswith(TEMP_PREFIX)
    assert list(store.ls("ranks")) == ["1.json"]


@pytest.fixture
def silent_s3(s3_endpoint):
    """An S3 endpoint that accepts connections and never answers (a hung object store)."""
    import socket

    import fsspec.config

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # kept open, never read or answered
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    conf = fsspec.config.conf["s3"]
    saved = conf["endpoint_url"]
    conf["endpoint_url"] = f"http://127.0.0.1:{srv.getsockname()[1]}"
    yield
    conf["endpoint_url"] = saved
    stop.set()
    th.join()
    for c in held:
        c.close()
    srv.close()


@pytest.mark.serial  # the bound is timed
@pytest.mark.parametrize("op", ["read_bytes", "ls", "write_bytes"])
def test_a_request_that_never_returns_fails_within_its_bound(silent_s3, op):
    # obstore serves read_bytes, s3fs the rest: both must honour the timeout, neither retry on its own
    s = Storage("s3://hung-bucket/x", StorageConfig(request_timeout_s=0.5, retries=2, backoff_s=0.01))
    args = {"read_bytes": ("a.bin",), "ls": ("",), "write_bytes": ("a.bin", b"x")}[op]
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="after 2 attempts"):
        getattr(s, op)(*args)
    took = time.monotonic() - t0
    assert took < 2 * 2 * 0.5 + 1.0, f"{op} took {took:.1f}s"  # connect+request per attempt at most


class InFlight:
    """Stands in for one Storage method: each call waits (at most 3 s) until `want` calls are in
    flight at once, then all go on. Calls made one after another never get there (`most` stays 1)."""

    def __init__(self, fn, want: int):
        self.fn, self.want, self.now, self.most = fn, want, 0, 0
        self.cv = threading.Condition()

    def __call__(self, *args):
        with self.cv:
            self.now += 1
            self.most = max(self.most, self.now)
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.most >= self.want, timeout=3)
        try:
            return self.fn(*args)
        finally:
            with self.cv:
                self.now -= 1


@pytest.mark.parametrize("reader", ["commits", "incomplete", "attempts", "rescues", "faults"])
def test_what_a_start_reads_from_the_store_it_reads_several_at_a_time(tmp_path, dist1, reader):
    """A restart waits on these reads: a record per step dir, per earlier attempt, per rescue, per
    fired fault. One round trip after another, every failure would lengthen the next restart."""
    n = 4
    mgr = manager(tmp_path, "dcp_sync", dist1, keep_last=n)
    store = mgr.storage
    if reader == "commits":
        app, *_ = make_app(1)
        for step in range(1, n + 1):
            mgr.save(step, app)
        mgr.wait()
    elif reader == "incomplete":
        for step in range(1, n + 1):
            os.makedirs(tmp_path / "remote" / f"step-{step:09d}")  # a save that never committed
    elif reader == "attempts":
        for _ in range(n):
            Attempts(store).begin(None)
    elif reader == "rescues":
        for a in range(n):
            rec = {"attempt": a, "rank": 0, "time": 1.0, "reached": a, "step": a, "outcome": "committed",
                   "seconds": 0.1}  # fmt: skip
            store.write_bytes(f"{RECORDS}/attempt{a:04d}-rank0.json", json.dumps(rec).encode())
    else:
        for a in range(n):
            store.write_bytes(f"faults/kill-{a}.fired", json.dumps({"attempt": a}).encode())
    name = "exists" if reader == "incomplete" else "read_bytes"
    probe = InFlight(getattr(store, name), want=3)
    setattr(store, name, probe)
    read = {
        "commits": lambda: [r["step"] for r in mgr.committed()],
        "incomplete": lambda: (mgr.clean_incomplete(), sorted(os.listdir(tmp_path / "remote")))[1],
        "attempts": lambda: [a["attempt"] for a in Attempts(store).previous()],
        "rescues": lambda: [r["attempt"] for r in Rescues(store).records()],
        "faults": lambda: sorted(m["attempt"] for m in Faults(store, 0).fired().values()),
    }[reader]
    got = read()
    assert probe.most >= 3, f"{reader}: at most {probe.most} {name} call(s) in flight at once"
    # what the readers return is what they returned one by one: every record, in its order
    assert got == {"commits": [4, 3, 2, 1], "incomplete": []}.get(reader, list(range(n)))


def test_each_keeps_the_order_and_raises_the_first_error_in_it():
    def fn(x):
        if x in (2, 5):
            raise ValueError(x)
        return x * 10

    assert each(fn, range(2)) == [0, 10] and each(fn, []) == []
    with pytest.raises(ValueError, match="2"):
        each(fn, range(8))
