"""Everything around the checkpoint files is input too: paths from data, names and links in the store.

The attacker here can write to the dataset (its manifests, listings, packed index) or the checkpoint
store. Each test crafts what they would write and asserts that nothing was written or read outside
the root, and that the run refused with a message naming the file and the row or entry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import xxhash
from helpers import DEEP, REPO, make_app, manager
from helpers import manifest_dataset as _manifest_dataset
from helpers import two_steps as _two_steps

from goodput.checkpoint.layout import COMMIT, CommitError, parse_commit, parse_manifest
from goodput.checkpoint.manager import SaveFailed
from goodput.config import RunConfig
from goodput.data.dataset import DataRootError, ImageFolder
from goodput.data.shards import INDEX, ShardSource, pack
from goodput.data.sources import CachedSource
from goodput.resilience.accounting import Attempts, Ledger
from goodput.resilience.bookkeeping import Goodput
from goodput.resilience.fault import Faults
from goodput.resilience.lock import RunLock
from goodput.run.config import TrainerConfig
from goodput.run.context import RunContext
from goodput.run.job import AlreadyDone, _prepare_run
from goodput.storage.checksum import CHECKSUM, TooLarge
from goodput.storage.remote import Storage
from goodput.tracking import MlflowConfig, start_run
from goodput.untrusted import UnsafePath, confined, safe_rel, why_unsafe


def _wait_idle(src: CachedSource, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while src._inflight and time.monotonic() < deadline:
        time.sleep(0.01)


def test_safe_rel_accepts_plain_paths_and_names_each_problem():
    for ok in ("train/a/x.jpg", "x", "a.b/c-d_e.png", "s3:bucket"):
        assert safe_rel(ok, "t") == ok
    for bad, why in [
        ("/etc/passwd", "absolute"),
        ("../x", ".."),
        ("a/../../x", ".."),
        ("a/./x", "normalised"),
        ("a//x", "normalised"),
        ("a/", "normalised"),
        ("", "empty"),
        ("~/x", "~"),
        ("C:/x", "drive"),
        ("c:x", "drive"),
        ("a\\..\\x", "backslash"),
        ("a\x00b", "NUL"),
        ("s3://bucket/x", "URL"),
        ("file:///etc/passwd", "URL"),
        (3, "not a string"),
    ]:
        assert why in why_unsafe(bad), bad
        with pytest.raises(UnsafePath, match=re.escape("rows.csv line 7")):
            safe_rel(bad, "rows.csv line 7")


def test_confined_refuses_a_symlink_below_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert confined(str(root), "a/b", "t") == os.path.join(os.path.realpath(root), "a", "b")
    with pytest.raises(UnsafePath, match="symbolic link"):
        confined(str(root), "link/x", "t")


@pytest.mark.parametrize(
    "row",
    [
        "{outside}/evil.pth",  # absolute: os.path.join(cache, row) is the row itself
        "../secret.txt",  # a file beside data.root, copied into the cache
        "pics/../../secret.txt",
        "s3://bucket/evil.pth",
        "file://{outside}/evil.pth",
    ],
)
def test_a_csv_row_outside_the_root_is_refused_and_nothing_is_written(folder, tmp_path, row):
    data, cache, outside = tmp_path / "data", tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    rows = _manifest_dataset(folder, data)
    (tmp_path / "secret.txt").write_text("not a sample")
    bad = row.format(outside=outside)
    if bad.startswith("/"):  # the attacker mirrors the target under the root, so the listing "finds" it
        mirror = data / bad.lstrip("/")
        mirror.parent.mkdir(parents=True)
        mirror.write_bytes(b"import os; os.system('touch pwned')\n")
    rows.insert(3, f"{bad},circle")
    (data / "train.csv").write_text("\n".join(rows) + "\n")
    src = CachedSource(Storage(str(data)), str(cache), prefetch_threads=2)
    with pytest.raises(DataRootError, match=rf"train\.csv line 4: path {re.escape(repr(bad))}.*refused"):
        src.open("train", {"_target_": "goodput.data.dataset.CsvManifest"})
    # The listing is the first line; the cache itself is the second: a row that got past it (a dataset
    # class of one's own) still never becomes a write outside the cache nor a read outside the root.
    src.prefetch([bad], set())
    _wait_idle(src)
    with pytest.raises(UnsafePath):
        src.read(bad)
    src.close()
    assert not (outside / "evil.pth").exists()
    assert not list(outside.iterdir())
    copied = [f for _, _, fs in os.walk(cache) for f in fs if not f.startswith(".lock-")]
    assert copied == [], copied  # the secret beside data.root was not copied in either
    assert not (cache / "secret.txt").exists()


def test_a_listed_key_outside_the_split_is_refused(tmp_path):
    """On an object store a key is any string: `train/../../x` is listed like any other."""
    store = Storage(f"memory://trust-{os.getpid()}/data")
    store.write_bytes("train/a/ok.jpg", b"x")
    store.fs.pipe_file(f"{store._base}/train/a/../../../evil.jpg", b"y")  # a raw key, as a writer could
    try:
        with pytest.raises(DataRootError, match=r"lists 'a/\.\./\.\./\.\./evil\.jpg'.*\.\."):
            ImageFolder(store, "train")
    finally:
        store.fs.rm(f"/trust-{os.getpid()}", recursive=True)


def _packed(folder, dst):
    pack(Storage(folder), Storage(str(dst)), shard_bytes=3000)
    return json.loads((dst / INDEX).read_text())


@pytest.mark.parametrize(
    "name", ["{outside}/evil.tar", "../evil.tar", "train/../../evil.tar", "s3://b/e.tar"]
)
def test_an_index_with_a_shard_outside_the_root_is_refused(folder, tmp_path, name):
    packed, cache, outside = tmp_path / "packed", tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    index = _packed(folder, packed)
    bad = name.format(outside=outside)
    real = packed / index["splits"]["train"]["shards"][1]["name"]
    index["splits"]["train"]["shards"][1]["name"] = bad
    if bad.startswith("/"):  # the attacker's bytes where the absolute name points: a GET would copy them
        os.replace(real, bad)
    (packed / INDEX).write_text(json.dumps(index))
    src = ShardSource(Storage(str(packed)), str(cache))
    with pytest.raises(UnsafePath, match=rf"index\.json splits\.train\.shards\[1\].*{re.escape(repr(bad))}"):
        src.open("train")
    src.where = {"x": (bad, 0, 1)}  # past the index check: the cache still refuses to write there
    src.prefetch(["x"], set())
    _wait_idle(src)
    src.close()
    written = [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".tar") and not f.startswith(".")]
    assert written == []
    assert not (tmp_path / "evil.tar").exists() and not (cache.parent / "evil.tar").exists()


def test_an_index_with_a_location_past_its_shard_is_refused(folder, tmp_path):
    index = _packed(folder, tmp_path / "packed")
    index["splits"]["train"]["samples"][2][1] = 10**9
    (tmp_path / "packed" / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"splits\.train sample 2: bad location"):
        ShardSource(Storage(str(tmp_path / "packed")), str(tmp_path / "cache")).open("train")


def test_storage_never_reads_or_writes_through_a_link_or_outside_its_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("s")
    (root / "step-000000001").symlink_to(outside, target_is_directory=True)
    os.mkfifo(root / "fifo")
    store = Storage(str(root))
    for call in (
        lambda: store.write_bytes("step-000000001/COMMIT.json", b"{}"),
        lambda: store.read_bytes("step-000000001/secret"),
        lambda: store.read_bytes("../outside/secret"),
        lambda: store.write_bytes("/tmp/x", b""),
        lambda: store.read_bytes("fifo"),  # would block forever
    ):
        with pytest.raises(UnsafePath):
            call()
    assert sorted(os.listdir(outside)) == ["secret"]
    assert store.ls()["step-000000001"] == -2 and store.ls()["fifo"] == -2  # FOREIGN: neither file nor dir


# -- names and links in the checkpoint store ---------------------------------------------------------
@pytest.mark.parametrize("spelling", ["step-1", "step-0000000001", "step-\u0661\u0662\u0663", "step-\u00b2"])
def test_another_spelling_is_ignored_and_never_moves_the_real_newest(tmp_path, dist1, caplog, spelling):  # noqa: F811
    mgr, app, remote = _two_steps(tmp_path, dist1)
    shutil.copytree(remote / "step-000000001", remote / spelling)  # an old step, renamed
    relaunch = manager(tmp_path, "dcp_sync", dist1)
    relaunch.clean_incomplete()  # never crashes on a name int() refuses (step-²)
    found = relaunch.committed()
    assert [r["step"] for r in found] == [2, 1]
    assert any(spelling in r.message and "ignoring" in r.message for r in caplog.records)
    rec, _ = relaunch.restore(make_app(5)[0], found)
    relaunch.supersede_after(rec["step"])
    assert rec["step"] == 2 and (remote / "step-000000002").is_dir()  # the real newest stays
    assert (remote / spelling).is_dir()  # the foreign entry is left alone, never moved over anything


def test_steps_are_ordered_by_number_not_by_name(tmp_path, dist1):  # noqa: F811
    mgr = manager(tmp_path, "dcp_sync", dist1)
    app, *_ = make_app(1)
    for step in (999999999, 1000000000):  # 9 then 10 digits: "step-1..." sorts below "step-9..."
        mgr.save(step, app)
    assert [r["step"] for r in mgr.committed()] == [1000000000, 999999999]


def test_a_step_dir_that_is_a_link_is_never_written_through_nor_loaded(tmp_path, dist1, caplog):  # noqa: F811
    mgr, app, remote = _two_steps(tmp_path, dist1)
    other = tmp_path / "other-run" / "step-000000003"  # another run's committed checkpoint
    shutil.copytree(remote / "step-000000002", other)
    before = {p.name: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    (remote / "step-000000003").symlink_to(other, target_is_directory=True)
    relaunch = manager(tmp_path, "dcp_sync", dist1)
    assert [r["step"] for r in relaunch.committed()] == [2, 1]  # the link is not a step
    assert any("step-000000003" in r.message and "symbolic link" in r.message for r in caplog.records)
    with pytest.raises(SaveFailed, match=r"step-000000003 is a symbolic link"):
        relaunch.save(3, app)
    assert {p.name: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before


def test_a_committed_file_that_is_a_fifo_or_link_is_never_opened(tmp_path, dist1):  # noqa: F811
    mgr, app, remote = _two_steps(tmp_path, dist1)
    for p in (tmp_path / "staging").glob("step-*"):
        shutil.rmtree(p)  # the remote is what is read
    step = remote / "step-000000002"
    rec = json.loads((step / COMMIT).read_text())
    victim = next(n for n in rec["files"] if n != ".metadata")
    os.unlink(step / victim)
    os.mkfifo(tmp_path / "fifo")
    (step / victim).symlink_to(tmp_path / "fifo")  # its stat size (0) matches the re-signed record
    rec["files"][victim] = {"bytes": 0, CHECKSUM: xxhash.xxh3_128(b"").hexdigest()}
    (step / COMMIT).write_text(json.dumps(rec))
    out = {}
    th = threading.Thread(
        target=lambda: out.update(r=mgr.restore(make_app(5)[0], mgr.committed())), daemon=True
    )
    th.start()
    th.join(30)
    assert not th.is_alive(), "restore blocked on the FIFO"
    rec, skipped = out["r"]
    assert rec["step"] == 1, skipped


def test_a_download_stops_at_the_recorded_size(tmp_path):
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "big").write_bytes(b"x" * (3 << 20))
    store = Storage(str(tmp_path / "remote"))
    store.CHUNK = 1 << 16
    with pytest.raises(TooLarge, match="1000 bytes"):
        store.get("big", str(tmp_path / "local"), limit=1000)
    assert not (tmp_path / "local").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert store.get("big", str(tmp_path / "local"), limit=3 << 20).size == 3 << 20


# -- the small records -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "record", [DEEP, b'{"step": ' + DEEP + b"}", b"\xff\xfe", b"[1, 2]", b'{"step": 1e999999}', b"1" * 5000]
)
def test_a_malformed_commit_record_is_a_refusal_naming_the_file(tmp_path, dist1, caplog, record):  # noqa: F811
    mgr, app, remote = _two_steps(tmp_path, dist1)
    (remote / "step-000000002" / COMMIT).write_bytes(record)
    assert [r["step"] for r in mgr.committed()] == [1]
    assert any("step-000000002/COMMIT.json" in r.message for r in caplog.records)
    for parse in (lambda: parse_commit(record, "step-000000002"), lambda: parse_manifest(record, 0)):
        with pytest.raises(CommitError):
            parse()


@pytest.mark.parametrize(
    "record",
    [b"", b"not json", DEEP, b"[]", b'{"host": 1}', b'{"host": "h", "pid": "7", "token": "t", "started": 0}',
     b'{"host": "h", "pid": 99999999999999999999, "token": "t", "started": 0}',
     b'{"host": "h", "pid": 7, "token": "../../x", "started": 0}'],
)  # fmt: skip
def test_a_malformed_lock_is_moved_aside_and_the_job_runs(tmp_path, caplog, record):
    store = Storage(str(tmp_path))
    (tmp_path / RunLock.NAME).write_bytes(record)
    lock = RunLock(store)
    lock.acquire()
    lock.release()
    asides = [p for p in tmp_path.iterdir() if p.name.startswith(f"{RunLock.NAME}.malformed-")]
    assert len(asides) == 1 and asides[0].read_bytes() == record
    assert any("moving it to" in r.message and RunLock.NAME in r.message for r in caplog.records)


def test_a_lock_naming_this_process_with_another_token_is_stale(tmp_path, caplog):
    """A container restarted with the same PID: the old lock names the new process."""
    store = Storage(str(tmp_path))
    old = RunLock(store)
    store.write_bytes(RunLock.NAME, json.dumps(old.record).encode())  # the previous life of this PID
    new = RunLock(store)
    new.acquire()
    new.release()
    assert any("names this process" in r.message for r in caplog.records)


@pytest.mark.parametrize("record", [DEEP, b"{}", b'{"attempt": 1, "start": "x"}', b"[]", b"\xff"])
def test_a_malformed_attempt_record_is_moved_aside_and_counted(tmp_path, caplog, record):
    store = Storage(str(tmp_path))
    first = Attempts(store)
    first.begin(None)
    (tmp_path / "attempts" / "0001.json").write_bytes(record)
    second = Attempts(store)
    assert [a["attempt"] for a in second.previous()] == [0]
    assert any("attempts/0001.json" in r.message and "moving it" in r.message for r in caplog.records)
    assert second.begin(None) == 2  # the number stays taken: nothing is overwritten
    assert second.lost_steps() == 0
    assert sorted(p.name for p in (tmp_path / "attempts").iterdir() if not p.name.startswith("0001"))[1] == (
        "0002.json"
    )


def _books(store, run_dir):
    """Rank 0's bookkeeping of one start, on the real fault markers of `store`."""
    tracker = SimpleNamespace(set_tags=lambda tags: None, log=lambda *a: None)
    return Goodput(Ledger(), store, 0, 1, str(run_dir), tracker, Faults(store, 0))


@pytest.mark.parametrize(
    "name, record",
    [
        ("hung-attempt0-rank0.fired", b'{"attempt": "0", "detected": 1.0, "hung_seconds": 2.0}'),
        ("hung-attempt0-rank0.fired", b'{"detected": 1.0, "hung_seconds": 2.0}'),  # no attempt
        ("hung-attempt0-rank0.fired", b'{"attempt": 0, "detected": "soon", "hung_seconds": 2.0}'),
        ("hung-attempt0-rank0.fired", b'{"attempt": 0, "detected": 1.0, "hung_seconds": NaN}'),
        ("hung-attempt0-rank1.fired", b'{"attempt": 0, "detected": 1e999, "hung_seconds": 2.0}'),
        ("hung-attempt0-rank0.fired", b"[]"),
        ("hung-attempt0-rank0.fired", DEEP),
        ("kill_at_step-3.fired", b'{"time": "yesterday", "rank": 0, "attempt": 0}'),
    ],
)  # fmt: skip
def test_a_malformed_fault_marker_is_moved_aside_and_the_start_goes_on(tmp_path, caplog, name, record):
    """The watchdog's hang records and the drills' markers are read at every start (the hung time the
    restored ledger lacks, the failure time of a restart): one with a wrong type or a missing key
    used to crash each start; now it is moved aside, named, and the start is counted."""
    store = Storage(str(tmp_path / "ckpt"))
    store.write_bytes(f"faults/{name}", record)
    good = b'{"attempt": 0, "detected": 5.0, "hung_seconds": 3.0, "rank": 1, "step": 4, "time": 2.0}'
    store.write_bytes("faults/hung-attempt0-rank9.fired", good)
    books = _books(store, tmp_path)
    assert books.begin(None, time.time()) == 0
    assert books.ledger.totals["hung"] == 3.0  # the good record still counts
    aside = [p.name for p in (tmp_path / "ckpt" / "faults").iterdir() if ".malformed-" in p.name]
    assert len(aside) == 1 and aside[0].startswith(name)
    assert (tmp_path / "ckpt" / "faults" / aside[0]).read_bytes() == record  # kept for a look
    assert any(f"faults/{name}" in r.message and "moving it to" in r.message for r in caplog.records)


@pytest.mark.parametrize(
    "compile_, recovery",
    [
        ([1.5], None),  # not a mapping: passed the check, then crashed the summary at the end
        ("fast", None),
        ({"first_step_seconds": "1.5"}, None),
        ({"first_step_seconds": 1.5, "fxgraph_cache_hit": -1}, None),
        ({"first_step_seconds": 1.5, "attempt": 7}, None),  # would overwrite the record's own number
        (None, {"seconds": {"built": 1.0}, "at": {"built": "noon"}}),
        (None, {"seconds": {}, "compile_seconds": [2]}),
    ],
)  # fmt: skip
def test_an_attempt_record_with_a_malformed_part_is_moved_aside_and_the_summary_written(
    tmp_path, caplog, compile_, recovery
):
    store = Storage(str(tmp_path / "ckpt"))
    first = _books(store, tmp_path)
    first.begin(None, time.time())
    parts = {k: v for k, v in (("compile", compile_), ("recovery", recovery)) if v is not None}
    store.write_bytes("attempts/0000.json", json.dumps({**first.attempts.record, **parts}).encode())
    second = _books(store, tmp_path)
    assert second.begin(None, time.time()) == 1  # the number stays taken
    summary = second.summary(12)
    assert summary["compile"] == [] and summary["recovery"]["per_restart"] == []
    assert json.dumps(summary)  # what write_summary writes
    assert [p.name for p in (tmp_path / "ckpt" / "attempts").iterdir() if ".malformed-" in p.name]
    assert any("attempts/0000.json" in r.message and "moving it to" in r.message for r in caplog.records)


def test_a_well_formed_compile_record_reaches_the_summary(tmp_path):
    store = Storage(str(tmp_path / "ckpt"))
    first = _books(store, tmp_path)
    first.begin(None, time.time())
    paid = {
        "first_step_seconds": 1.5,
        "cache_artifacts_loaded": 0,
        "cache_source": None,
        "fxgraph_cache_miss": 3,
    }
    first.attempts.record["compile"] = paid
    first.attempts.beat(4)
    second = _books(store, tmp_path)
    second.begin(None, time.time())
    assert second.summary(12)["compile"] == [{"attempt": 0, **paid}]


@pytest.mark.parametrize(
    "part, state",
    [
        ("best", {"by": "val/loss", "mode": "min", "step": "8", "value": 0.5}),
        ("best", {"by": "val/loss", "mode": "min", "step": 8, "value": "low"}),
        ("best", {"by": "val/loss", "mode": "min", "step": -8, "value": 0.5}),
        ("best", [8, 0.5]),
        ("early_stopping", {"by": "val/loss", "best": 0.5, "bad": "2", "stopped_at": None}),
        ("early_stopping", {"by": "val/loss", "best": 0.5, "stopped_at": None}),
        ("early_stopping", {"by": "val/loss", "best": {"v": 1}, "bad": 0, "stopped_at": None}),
    ],
)  # fmt: skip
def test_a_malformed_best_or_early_stopping_state_starts_over(caplog, part, state):
    """A checkpoint's best-so-far and early-stopping counter are records too: a malformed one used to
    load, then crash the first evaluation; now the checkpoint loads and that part starts over, warned."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from goodput.checkpoint.state import encode
    from goodput.monitor import Best, EarlyStopping

    app, *_ = make_app(1)
    best, early = Best("val/loss", None), EarlyStopping(3, "val/loss", 0.0, None)
    app.register("best", best, missing="checkpoint.keep_best_by's best so far starts over")
    app.register("early_stopping", early, missing="the early-stopping counter starts from zero")
    opts = StateDictOptions()
    sd = app.state_dict(opts)
    sd["extra"][part] = encode(state)
    app.apply(sd, opts, step=8)
    assert (best.step, best.value, early.best, early.bad) == (None, None, None, 0)
    assert best.observe({"val/loss": 0.4}, 12) and not early.update({"val/loss": 0.4}, 12)
    assert any(f"extra.{part}" in r.message and "step 8" in r.message for r in caplog.records)


class _Counting:
    """A file object that counts the bytes that pass through it."""

    def __init__(self, f, counts: list):
        self.f, self.counts = f, counts

    def read(self, n=-1):
        buf = self.f.read(n)
        self.counts[0] += len(buf)
        return buf

    def write(self, buf):
        self.counts[1] += len(buf)
        return self.f.write(buf)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


def test_a_padded_checkpoint_file_is_not_downloaded_past_its_recorded_size(tmp_path, dist1, monkeypatch):  # noqa: F811
    """Export (inspect_checkpoint.py --export, the model logged to MLflow) reads a commit's files like
    a restore: a file padded after its commit is read for at most its recorded size (+1 byte that
    tells it is longer) and written locally for at most that size, then refused; --verify reads no
    further either."""
    import contextlib

    from goodput.checkpoint import export
    from goodput.storage import remote as remote_mod

    mgr, app, remote = _two_steps(tmp_path, dist1)
    rec = mgr.committed()[0]
    name, want = max(rec["files"].items(), key=lambda kv: kv[1]["bytes"])
    with open(remote / rec["dir"] / name, "ab") as f:
        f.write(b"\0" * (8 << 20))  # 8 MiB past the record
    counts = {}  # file name -> [bytes read from the store, bytes written locally]
    store = mgr.storage
    real_open, real_atomic = store.fs.open, remote_mod.atomic_file

    def counted_open(path, mode="rb", **kw):
        return _Counting(real_open(path, mode, **kw), counts.setdefault(os.path.basename(path), [0, 0]))

    @contextlib.contextmanager
    def counted_atomic(path, *a, **kw):
        with real_atomic(path, *a, **kw) as out:
            yield _Counting(out, counts.setdefault(os.path.basename(path), [0, 0]))

    monkeypatch.setattr(store.fs, "open", counted_open)
    monkeypatch.setattr(remote_mod, "atomic_file", counted_atomic)
    with pytest.raises(export.ExportError, match=re.escape(f"{rec['dir']}/{name}")):
        export.model_state(store, rec)
    read, written = counts[name][0], counts[name][1]
    assert read <= want["bytes"] + 1 and written <= want["bytes"], (read, written, want["bytes"])
    counts.clear()  # inspect_checkpoint.py --verify streams it through the checksum the same way
    spec = importlib.util.spec_from_file_location(
        "inspect_checkpoint", REPO / "scripts" / "inspect_checkpoint.py"
    )
    inspect_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect_checkpoint)
    problems = inspect_checkpoint.verify(store, rec["dir"])
    assert problems == [
        f"{store.url(rec['dir'] + '/' + name)}: longer than the {want['bytes']} bytes its commit records"
    ]
    assert counts[name][0] <= want["bytes"] + 1, counts


def raw_controls(text: str) -> list[str]:
    """The characters of `text` a terminal would act on (line ends aside)."""
    return [c for c in text.replace("\r\n", "\n") if not c.isprintable() and c != "\n"]


def test_record_strings_are_printed_escaped_by_inspect_checkpoint(tmp_path, dist1, monkeypatch, capsys):  # noqa: F811
    """A `\r` and an erase-line sequence in a record's stop_reason rewrote inspect_checkpoint.py's
    line: a step whose shard has the wrong size read "committed". Every record string is escaped."""
    import runpy

    mgr, app, remote = _two_steps(tmp_path, dist1)
    mgr.close()
    rec = json.loads((remote / "step-000000002" / COMMIT).read_text())
    shard = next(n for n in rec["files"] if n.endswith(".distcp"))
    (remote / "step-000000002" / shard).write_bytes(b"short")  # wrong size: not "committed"
    erase = "\r\x1b[2K"
    rec.update(
        stop_reason=f"x{erase}         2  dcp_sync       1      0.10  committed",
        backend=f"dcp_sync{erase}\x1b]0;title\x07",
        best={"step": 2, "by": f"val/loss{erase}\u202e", "mode": "min", "value": 0.5},
        metric={f"val/loss{erase}": 0.5},
    )
    (remote / "step-000000002" / COMMIT).write_text(json.dumps(rec))
    step1 = json.loads((remote / "step-000000001" / COMMIT).read_text())
    (remote / "step-000000001" / COMMIT).write_text(
        json.dumps({**step1, "backend": f"b{erase}", "best": rec["best"]})
    )
    script = str(REPO / "scripts" / "inspect_checkpoint.py")
    for argv in ([str(remote)], ["--verify", str(remote)], ["--verify", str(remote / "step-000000002")],
                 [str(remote), "--export", str(tmp_path / "m.safetensors"), "--step", "1"]):  # fmt: skip
        monkeypatch.setattr("sys.argv", [script, *argv])
        with contextlib.suppress(SystemExit):
            runpy.run_path(script, run_name="__main__")
        out = capsys.readouterr()
        assert not raw_controls(out.out + out.err), (argv, out)
    monkeypatch.setattr("sys.argv", [script, str(remote)])
    runpy.run_path(script, run_name="__main__")
    table = capsys.readouterr().out
    (row,) = [line for line in table.splitlines() if line.strip().startswith("2 ")]
    assert "files missing/wrong size" in row and "stopped: x\\r\\x1b[2K" in row, row
    assert "best: step 2 (val/loss\\r\\x1b[2K\\u202e = 0.5, min)" in table, table


# -- decisions taken from a commit use a verified one ------------------------------------------------
def _job_cfg(tmp_path, name: str, max_steps: int) -> SimpleNamespace:
    """The nodes the job's decisions read (goodput.run.job._prepare_run), as the schemas build them."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    return SimpleNamespace(
        run=RunConfig(name=name),
        trainer=TrainerConfig(max_steps=max_steps),
        mlflow=MlflowConfig(tracking_uri=uri, experiment="trust", artifact_location=None),
    )


CTX = RunContext("unused", 0.0, "1" * 16)


def test_a_junk_step_ahead_with_wrong_checksums_does_not_end_the_job(tmp_path, dist1, caplog):  # noqa: F811
    mgr, app, remote = _two_steps(tmp_path, dist1)
    junk = remote / "step-000000100"
    shutil.copytree(remote / "step-000000002", junk)
    rec = json.loads((junk / COMMIT).read_text())
    rec["step"] = 100
    (junk / COMMIT).write_text(json.dumps(rec))
    shard = next(p for p in junk.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum tells
    shard.write_bytes(bytes(data))
    committed = mgr.committed()
    assert committed[0]["step"] == 100  # the cheap checks pass it
    c = _job_cfg(tmp_path, "r", max_steps=12)
    _prepare_run(c, CTX, mgr, committed, False, {})  # not AlreadyDone: step 2 is the newest that verifies
    assert any("not trusting" in r.message and "step-000000100" in r.message for r in caplog.records)
    c = _job_cfg(tmp_path, "r", max_steps=2)
    with pytest.raises(AlreadyDone, match="step-000000002"):
        _prepare_run(c, CTX, mgr, committed, False, {})


def test_a_commit_of_another_run_never_continues_its_mlflow_run(tmp_path, dist1, caplog):  # noqa: F811
    c = _job_cfg(tmp_path, "mine", max_steps=12)
    theirs = start_run(c.mlflow.tracking_uri, "trust", "theirs", {}, None)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    mgr.commit_info = {"mlflow_run_id": theirs, "run": "theirs", "config_hash": "0" * 16}
    mgr.save(1, make_app(1)[0])
    ctx = _prepare_run(c, CTX, mgr, mgr.committed(), True, {})
    assert ctx.mlflow_run_id not in (None, theirs)
    assert any("written by run 'theirs'" in r.message for r in caplog.records)
    c = _job_cfg(tmp_path, "theirs", max_steps=12)  # the run that wrote it does continue it
    ctx = _prepare_run(c, CTX, mgr, mgr.committed(), True, {})
    assert ctx.mlflow_run_id == theirs
    assert any("records no run identity" in r.message for r in caplog.records)


def test_record_strings_in_the_jobs_lines_are_escaped(tmp_path, dist1, caplog):  # noqa: F811
    """The job's "complete" line and its fence warning print a commit's stop_reason and run name."""
    erase = "\r\x1b[2K"
    c = _job_cfg(tmp_path, "mine", max_steps=12)
    for i, (info, extra) in enumerate(
        [({}, {"stop_reason": f"early{erase}"}), ({"run": f"theirs{erase}"}, {})]
    ):
        mgr = manager(tmp_path / str(i), "dcp_sync", dist1)
        mgr.commit_info = {"mlflow_run_id": f"r{erase}", "config_hash": "0" * 16, **info}
        mgr.save(1, make_app(1)[0], extra)
        mgr.close()
        try:
            _prepare_run(c, CTX, mgr, mgr.committed(), False, {})
        except AlreadyDone as e:
            assert i == 0 and "(early\\r\\x1b[2K)" in str(e) and not raw_controls(str(e)), str(e)
    (warning,) = [r.getMessage() for r in caplog.records if "written by run" in r.getMessage()]
    assert "written by run 'theirs\\r\\x1b[2K'" in warning and not raw_controls(warning), warning


# -- caches that outlive the truth -------------------------------------------------------------------
def test_a_cached_copy_of_a_since_fixed_remote_file_is_fetched_again(folder, tmp_path, caplog):
    data, cache = tmp_path / "data", tmp_path / "cache"
    shutil.copytree(folder, data)
    rel = ImageFolder(Storage(str(data)), "train").files[3]
    good = (data / rel).read_bytes()
    (data / rel).write_bytes(good[: len(good) // 2])  # truncated on the remote
    first = CachedSource(Storage(str(data)), str(cache))
    first.open("train")
    first.prefetch([rel], set())
    _wait_idle(first)
    assert first.read(rel)[0] == good[: len(good) // 2]  # cached as it was
    first.close()
    (data / rel).write_bytes(good)  # fixed on the remote, as the decode error advises
    for via_prefetch in (False, True):
        src = CachedSource(Storage(str(data)), str(cache))  # the next run lists the remote again
        src.open("train")
        if via_prefetch:
            (tmp_path / "cache").joinpath(os.path.relpath(src.local_path(rel), cache)).write_bytes(b"x")
            src.prefetch([rel], set())
            _wait_idle(src)
        got, hit, _ = src.read(rel)
        assert got == good, via_prefetch
        assert hit is via_prefetch  # the prefetch refetched it; else the read did
        src.close()
    assert any("the remote lists" in r.message and rel in r.message for r in caplog.records)


def test_a_cached_shard_of_the_wrong_size_is_fetched_again(folder, tmp_path):
    index = _packed(folder, tmp_path / "packed")
    store = Storage(str(tmp_path / "packed"))
    src = ShardSource(store, str(tmp_path / "cache"))
    files = src.open("train")
    rel = files.files[0]
    shard, off, n = files.where[rel]
    src.read(rel)
    src.close()
    with open(src.local_path(shard), "r+b") as f:
        f.truncate(off + n // 2)  # a short shard in the cache (a fill from a broken remote copy)
    src = ShardSource(store, str(tmp_path / "cache"))
    src.open("train")
    data, hit, fetched = src.read(rel)
    assert (
        data == store.read_bytes(shard)[off : off + n]
        and not hit
        and fetched == index["splits"]["train"]["shards"][0]["bytes"]
    )
    src.close()


def test_a_restore_from_the_local_copy_names_a_corrupt_remote_file(tmp_path, dist1, caplog):  # noqa: F811
    mgr, app, remote = _two_steps(tmp_path, dist1)
    rec = mgr.committed()[0]
    victim = next(n for n in rec["files"] if n != ".metadata")
    data = bytearray((remote / "step-000000002" / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF  # the remote copy rots; staging still holds a good one
    (remote / "step-000000002" / victim).write_bytes(bytes(data))
    got, _ = mgr.restore(make_app(5)[0], mgr.committed())
    assert got["step"] == 2  # served from the verified node-local copy
    mgr.remote_check.join(30)
    assert len(mgr.remote_corrupt) == 1 and f"step-000000002/{victim}" in mgr.remote_corrupt[0]
    assert any("remote copy of the restored checkpoint is bad" in r.message for r in caplog.records)
    assert (remote / "step-000000002" / victim).read_bytes() == bytes(data)  # reported, not rewritten
