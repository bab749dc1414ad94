"""The storage layer: fsspec roots, emulated latency/bandwidth, atomic writes, retries."""

from __future__ import annotations

import time

import pytest

from goodput.storage import Storage, StorageConfig, StorageError, file_digest


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
    assert not list((tmp_path / "r" / "a").glob("*.tmp*"))  # no temp files left behind
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
