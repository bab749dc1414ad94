"""Everything around the checkpoint files is input too: paths from data, names and links in the store.

The attacker here can write to the dataset (its manifests, listings, packed index) or the checkpoint
store. Each test crafts what they would write and asserts that nothing was written or read outside
the root, and that the run refused with a message naming the file and the row or entry.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from goodput.data.dataset import DataRootError, ImageFolder
from goodput.data.shards import INDEX, ShardSource, pack
from goodput.data.sources import CachedSource
from goodput.data.synthetic import make_dataset
from goodput.storage import Storage
from goodput.untrusted import UnsafePath, confined, safe_rel, why_unsafe


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    make_dataset(str(root), num_classes=2, train_per_class=4, val_per_class=1, image_size=16)
    return str(root)


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


def _manifest_dataset(folder, dst):
    """The demo data flattened under `pics/` with a train.csv naming each file."""
    os.makedirs(dst / "pics")
    rows = ["path,label"]
    src = ImageFolder(Storage(folder), "train")
    for i, (rel, label) in enumerate(zip(src.files, src.labels)):
        (dst / "pics" / f"{i}.jpg").write_bytes(Path(folder, rel).read_bytes())
        rows.append(f"pics/{i}.jpg,{src.classes[label]}")
    return rows


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
