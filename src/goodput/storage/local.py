"""Node-local files written atomically: a reader sees the old file or the new one, never a prefix.

Used for a local storage root (Storage.write_bytes/put), downloads, the cache and checkpoint
staging. Plain `os` calls: node-local disks pay none of the remote side's emulated costs.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMP_PREFIX = ".part-"
"""Name prefix of a file being written by `atomic_file` (hidden; the cache's scan skips it)."""


@contextmanager
def atomic_file(path: str, mode: str = "wb", durable: bool = True) -> Iterator[IO]:
    """Write a local file so that no reader ever sees it half-written: yields an open file on a
    unique temp name in the same directory; a clean exit flushes it and renames it over `path`
    (readers see the old file or the new one, never a prefix); an exception removes the temp file
    and leaves `path` as it was. Concurrent writers each get their own temp name; the last rename
    wins whole.

    `durable`: fsync the file before the rename and the directory after it, so the new content
    survives a power loss or kernel crash, not only a killed process (whose written pages the
    kernel keeps either way). Costs a disk flush per file (~10x a small write): what is committed
    or reported needs it; a download checked against its checksum, or a node-local cache, may not."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file: mode must be 'wb' or 'w', got {mode!r}")
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    # Hidden, and ending in .tmp: whoever lists the directory by suffix (manifests `<r>.json`,
    # attempt records, images) never mistakes a file being written for a finished one.
    tmp = os.path.join(d, f"{TEMP_PREFIX}{secrets.token_hex(6)}-{os.path.basename(path)[:100]}.tmp")
    # O_EXCL: never shares a name with another writer; 0o666 & umask, as open() would (mkstemp's
    # 0o600 would survive the rename and hide the file from other users).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(d)


def atomic_write(path: str, data: bytes | str, durable: bool = True) -> None:
    """`atomic_file` for content already in memory."""
    with atomic_file(path, "wb" if isinstance(data, bytes | bytearray | memoryview) else "w", durable) as f:
        f.write(data)


def exclusive_write(path: str, data: bytes) -> bool:
    """Create `path` with `data` only if nothing is there: True if this call created it, False if it
    existed. Whole or not at all, like atomic_write: the bytes go to a temp file of this writer's
    own, flushed to disk, and a hard link publishes them under `path` (link(2) fails when the name
    exists: the exclusive step)."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f"{TEMP_PREFIX}{secrets.token_hex(6)}-{os.path.basename(path)[:100]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(d)
    return True
