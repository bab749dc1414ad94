"""Pack an ImageFolder (local path or fsspec URL) into the shards `data=shards` reads.

    python scripts/pack_shards.py --src outputs/remote/data/mine --dst s3://bucket/mine-shards
    python scripts/train.py data=shards data.root=s3://bucket/mine-shards

Shards are WebDataset-style tar files (<key>.jpg + <key>.cls); index.json is written last, so a
destination with an index.json is complete. `data=shards` with data.root at an unpacked ImageFolder
packs it into <root>-shards on first use instead.
"""

import argparse
import time

from goodput.data.shards import DEFAULT_SHARD_BYTES, INDEX, pack
from goodput.storage.remote import Storage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, help="ImageFolder root: train/<class>/*, val/<class>/*")
    p.add_argument("--dst", required=True, help="where the shards and index.json go (path or URL)")
    p.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_BYTES / 2**20, help="target shard size")
    p.add_argument("--threads", type=int, default=16, help="parallel reads from --src")
    p.add_argument("--force", action="store_true", help="repack over an existing index.json")
    a = p.parse_args()
    dst = Storage(a.dst)
    if dst.exists(INDEX) and not a.force:
        p.error(f"{dst.url(INDEX)} exists: the destination is packed already (--force to repack)")
    t0 = time.time()
    idx = pack(Storage(a.src), dst, int(a.shard_mb * 2**20), a.threads)
    for split, s in idx["splits"].items():
        size = sum(sh["bytes"] for sh in s["shards"])
        print(f"{split}: {len(s['files'])} samples in {len(s['shards'])} shards, {size / 1e6:.1f} MB")
    print(f"packed into {a.dst} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
