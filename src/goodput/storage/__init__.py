"""Storage: the remote side (dataset, committed checkpoints, run markers) and node-local files.

One module per concern:
- `remote`: `Storage`, fsspec rooted at a URL, with retries and no listing cache; its config
  (`StorageConfig`, the `storage` node) and `check_url`.
- `emulation`: what a network volume costs (latency, bandwidth, injected errors), for a laptop;
  Storage calls `op()` per operation and `transfer(n)` per n bytes; on a cluster its settings stay 0.
- `s3`: s3fs specifics and obstore's faster client for s3 reads.
- `local`: atomic local files (temp + fsync + rename).
- `checksum`: the checksum every checkpoint transfer computes as the bytes stream.

The names below are re-exported so that `goodput.storage.Storage` stays the `_target_` a config
names (StorageConfig's default); code inside the package imports from the defining module.
"""

from goodput.storage.checksum import CHECKSUM, TooLarge, Transfer, file_digest
from goodput.storage.emulation import Emulation, InjectedFault
from goodput.storage.local import TEMP_PREFIX, atomic_file, atomic_write
from goodput.storage.remote import (
    DIR,
    FOREIGN,
    Storage,
    StorageConfig,
    StorageError,
    check_url,
    each,
    is_local,
)

__all__ = [
    "CHECKSUM",
    "DIR",
    "FOREIGN",
    "TEMP_PREFIX",
    "Emulation",
    "InjectedFault",
    "Storage",
    "StorageConfig",
    "StorageError",
    "TooLarge",
    "Transfer",
    "atomic_file",
    "atomic_write",
    "check_url",
    "each",
    "file_digest",
    "is_local",
]
