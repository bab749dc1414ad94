"""What is particular to s3: spotting an s3fs client, and obstore's faster client for its reads.

When obstore is installed, listings and GETs on s3:// take obstore (a fraction of s3fs's client
CPU per small file, docs/benchmarks.md); writes stay on s3fs. Same credentials, endpoint and
timeouts; its own retries off, since Storage retries.
"""

from __future__ import annotations

import os

_OBSTORE_PID = [None]  # the process whose obstore runtime is live (None: not used yet)
_S3FS_KEYS = {"endpoint_url", "key", "secret", "token", "client_kwargs"}


def _is_s3fs(fs) -> bool:
    return type(fs).__module__.startswith("s3fs")


def _obstore_for(fs, timeout_s: float = 30.0):
    """An obstore FsspecStore equivalent to an s3fs filesystem and a GET through obstore's own
    client, or None (not s3, not installed, after a fork, or options obstore would not honour the
    same way: then s3fs stays). The caller turns the store's listing cache off (remote._uncached)."""
    if not _is_s3fs(fs) or os.environ.get("GOODPUT_OBSTORE", "1") == "0":
        return None
    if _OBSTORE_PID[0] not in (None, os.getpid()):
        return None  # forked from a process that ran obstore: its runtime is gone here
    opts = dict(fs.storage_options)
    opts.pop("config_kwargs", None)  # our own timeouts (Storage._open): given to obstore below
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    endpoint = opts.pop("endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
    region = client_kwargs.pop("region_name", None)
    if client_kwargs or set(opts) - _S3FS_KEYS:
        return None
    try:
        from obstore.fsspec import FsspecStore
    except ImportError:
        return None
    from datetime import timedelta

    t = timedelta(seconds=timeout_s)
    kw: dict = {
        "client_options": {"timeout": t, "connect_timeout": t},
        "retry_config": {"max_retries": 0},  # obstore's own (10 retries, 3 min): ours are in _retry
    }
    if endpoint:
        kw["endpoint"] = endpoint
        if endpoint.startswith("http://"):
            kw["client_options"]["allow_http"] = True
    for src, dst in (("key", "access_key_id"), ("secret", "secret_access_key"), ("token", "token")):
        if opts.get(src):
            kw[dst] = opts[src]
    if region:
        kw["region"] = region
    _OBSTORE_PID[0] = os.getpid()
    return FsspecStore("s3", skip_instance_cache=True, **kw), _ObstoreGet(kw)


class _ObstoreGet:
    """A GET through obstore's own client, one store per bucket: about half the client CPU of the
    same GET through its fsspec adapter, which adds an asyncio hop per call (docs/benchmarks.md).
    Errors map to what the fsspec clients raise: FileNotFoundError for a missing key, OSError
    (retried) for the rest."""

    def __init__(self, kw: dict):
        self.kw, self.stores = kw, {}

    def __call__(self, path: str) -> bytes:
        import obstore
        from obstore.exceptions import BaseError, NotFoundError

        bucket, _, key = path.partition("/")
        store = self.stores.get(bucket)
        if store is None:
            from obstore.store import from_url

            store = self.stores.setdefault(bucket, from_url(f"s3://{bucket}", **self.kw))
        try:
            return obstore.get(store, key).bytes().to_bytes()
        except NotFoundError as e:
            raise FileNotFoundError(f"s3://{path}") from e
        except BaseError as e:
            raise OSError(f"s3://{path}: {e}") from e
