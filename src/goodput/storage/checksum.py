"""Checksums of what a checkpoint moves, computed while the bytes stream (no second pass).

Every upload, download and verification of a committed file goes through `_copy_hashing` or
`file_digest`, so the record's checksum and the one checked on restore are the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

# Checksum of every file a checkpoint moves. xxh3_128 streams at tens of GB/s on one core (sha256
# about 2 GB/s here), so hashing while the bytes go out costs nothing next to the transfer. It
# detects corruption, not forgery: whoever can write the commit record can write its checksums too.
CHECKSUM = "xxh3_128"


@dataclass(frozen=True)
class Transfer:
    """What moved: the byte count and its checksum, computed while the bytes streamed through."""

    size: int
    digest: str


class TooLarge(ValueError):
    """A download that went past the size its record allows (a store file grown or replaced)."""


def _copy_hashing(src, dst, chunk: int, limit: int | None = None) -> Transfer:
    """Copy src to dst, hashing; with `limit`, stop (TooLarge) as soon as more than `limit` bytes came."""
    h, n = xxhash.xxh3_128(), 0
    while True:
        buf = src.read(chunk if limit is None else min(chunk, limit + 1 - n))
        if not buf:
            return Transfer(n, h.hexdigest())
        n += len(buf)
        if limit is not None and n > limit:
            raise TooLarge(f"more than the {limit} bytes recorded")
        h.update(buf)
        dst.write(buf)


def file_digest(path: str, chunk: int = 1 << 22) -> Transfer:
    """Checksum of a local file (verifying a node-local copy before it is used)."""
    h, n = xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        while buf := f.read(chunk):
            h.update(buf)
            n += len(buf)
    return Transfer(n, h.hexdigest())
