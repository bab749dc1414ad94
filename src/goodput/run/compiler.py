"""torch.compile for the trained model: compile in place, time it, keep its cache across restarts.

- The parallel strategy compiles the model it wrapped (`Single.compile` in goodput.parallel), in
  place: the state-dict keys stay those of the plain module (no `_orig_mod.` prefix), so a
  checkpoint of a compiled run resumes uncompiled and back. Under DDP the wrapper is compiled, as
  torch asks (DDPOptimizer splits the graph at the bucket boundaries); under FSDP2 each unit's
  `forward`, with FSDP's hooks outside the compiled code.
- `CompileClock` tells the loop how many of the seconds it just timed were compiling (torch's own
  accounting of dynamo + inductor, forward and the lazily compiled backward): the ledger's `compile`.
  Only real compilation counts: dynamo's time on frames that produced no graph (it fell back to
  eager) stays in the step's time, and a first step that compiled nothing is warned about.
- `CompileCache` keeps compiled code across restarts: inductor's cache directory on node-local disk
  (what makes a restart on the same node warm: on CPU the C++ kernels are built there) and torch's
  portable cache artifacts (`torch.compiler.save_cache_artifacts`) beside it, optionally uploaded
  beside the checkpoints for a relaunch on a new node.

A compile cache is code: inductor's entries are pickled graphs and generated Python/C++ that run when
loaded, and torch writes each artifact to a path built from its key. So a copy read from the store is
loaded only when it carries a valid HMAC of this run's job, and every copy (the node-local one too)
only when its artifacts are what torch writes here (goodput.run.cache_trust). The local copy is as
trusted as the node. A sha256 in the header refuses a corrupt or truncated blob (and one from
another torch version) with a warning. Anything refused means a cold compile, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import torch

from goodput.run import cache_trust
from goodput.untrusted import UnsafePath, regular

log = logging.getLogger(__name__)

# Top-level entries of torch._dynamo.utils.compilation_time_metrics: a frame's compile (dynamo,
# AOTAutograd, inductor's forward; recompiles too) and the backward graph, compiled on first use.
FORWARD, BACKWARD = "_compile.compile_inner", "backward._backward_impl"
MAGIC = b"goodput-compile-cache\n"
ARTIFACTS = "artifacts.bin"  # torch's portable cache artifacts, in our envelope
REMOTE = "compile_cache/artifacts.bin"  # beside the checkpoints, in the checkpoint storage


class CompileClock:
    """Seconds torch spent compiling since the last `take()` (0.0 when nothing is compiled). After
    a compile, `take()` saves the cache (`CompileCache`), so a kill right after still finds it."""

    def __init__(self, enabled: bool, cache: CompileCache | None = None):
        self.enabled, self.cache = enabled, cache
        self.total = 0.0  # this process
        self._seen = self._now() if enabled else (0.0, 0.0, 0)
        self._start = self._seen[2]  # (torch's counters are the process's, from before this run)
        self.graphs = 0  # graphs dynamo compiled since
        self._first = True

    @staticmethod
    def _now() -> tuple[float, float, int]:
        from torch._dynamo.utils import compilation_time_metrics as m
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"]["unique_graphs"])
        return sum(m.get(FORWARD, ())), sum(m.get(BACKWARD, ())), graphs

    def take(self) -> float:
        if not self.enabled:
            return 0.0
        (fwd, bwd, graphs), (fwd0, bwd0, graphs0) = self._now(), self._seen
        self._seen = (fwd, bwd, graphs)
        # dynamo's time on frames that compiled no graph is not compiling: they ran eagerly
        dt = (max(0.0, fwd - fwd0) if graphs > graphs0 else 0.0) + max(0.0, bwd - bwd0)
        self.graphs = graphs - self._start
        if self._first and not self.graphs:
            log.warning("trainer.compile: torch compiled no graph in the first step: the model runs eagerly")
        self._first = False
        if dt > 0 and self.cache is not None:
            t0 = time.perf_counter()
            self.cache.save()
            dt += time.perf_counter() - t0  # part of what compiling cost
        self.total += dt
        return dt

    def paid(self) -> dict | None:
        """What this process paid torch.compile so far and where its cache came from (the attempt
        record's `compile`, read at the first step); None when compile is off."""
        if not self.enabled:
            return None
        return {"first_step_seconds": round(self.total, 4), "cache_artifacts_loaded": self.cache.loaded,
                "cache_source": self.cache.source, "graphs": self.graphs, **cache_counters()}  # fmt: skip


def cache_counters() -> dict:
    """Hits and misses of inductor's graph cache and AOTAutograd's cache in this process so far."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }


def wrap(payload: bytes, key: bytes | None = None) -> bytes:
    """The envelope: magic, a JSON header (torch version, sha256, size; with `key`, an HMAC of the
    header and payload: cache_trust.sign), the payload."""
    head = {"torch": torch.__version__, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    if key is not None:
        head["hmac"] = cache_trust.sign(key, _canonical(head), payload)
    return MAGIC + json.dumps(head).encode() + b"\n" + payload


def _canonical(head: dict) -> bytes:
    return json.dumps({k: v for k, v in head.items() if k != "hmac"}, sort_keys=True).encode()


def unwrap(blob: bytes, where: str, key: bytes | None = None) -> bytes | None:
    """The payload of a blob `wrap` made, or None (with a warning naming `where` and why). With
    `key` (a copy from the store), the blob must carry this run's HMAC."""
    why, head, payload = None, None, b""
    if not blob.startswith(MAGIC):
        why = "not a goodput compile cache (no header)"
    else:
        line, _, payload = blob[len(MAGIC) :].partition(b"\n")
        try:
            head = json.loads(line)
        except Exception:  # RecursionError too: the header is input
            head = None
        if not isinstance(head, dict):
            why = "unreadable header"
        elif head.get("torch") != torch.__version__:
            why = f"written by torch {head.get('torch')}, this is {torch.__version__}"
        elif head.get("size") != len(payload) or head.get("sha256") != hashlib.sha256(payload).hexdigest():
            why = "checksum mismatch (corrupt or truncated)"
        elif key is not None and not cache_trust.verify(key, _canonical(head), payload, head.get("hmac")):
            why = "no valid HMAC of this run's job (written by someone else, for another run, or altered)"
    if why:
        log.warning("ignoring the compile cache %s: %s; compiling from scratch", where, why)
        return None
    return payload


def load_artifacts(payload: bytes, where: str = "") -> object | None:
    """Hand the artifacts to torch (its CacheInfo), or None with a warning naming `where`.

    Every artifact is checked first (cache_trust.check_artifacts: only torch's own types, keys and
    paths), so this parses with torch's reader and populates as torch.compiler.load_cache_artifacts
    does, keeping every batch: save_cache_artifacts appends one (type, artifacts) batch per call to
    the bytes it returns (cumulative), but load's parser turns the batches into a dict by type, so
    only the last batch of each type is loaded, and a process that saved after its first step and
    again after its first evaluation would hand a new node the eval graphs only. Without torch's
    reader (private names gone in another torch) nothing is loaded: the artifacts cannot be checked."""
    try:
        from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except ImportError as e:
        log.warning("cannot check the compile cache %s (%s); compiling from scratch", where, e)
        return None
    try:
        CacheArtifactManager._ensure_cache_artifacts_registered()
        batches = AppendingByteSerializer.to_list(payload, deserialize_fn=_deserialize_single_cache)
        why = cache_trust.check_artifacts(batches)
    except Exception as e:  # torch's own checksum, a short or garbled payload, an unknown type
        why = f"torch cannot parse its artifacts: {type(e).__name__}: {str(e)[:200]}"
    if why is not None:
        log.warning("ignoring the compile cache %s: %s; compiling from scratch", where, why)
        return None
    merged: dict[str, list] = {}
    for kind, artifacts in batches:
        seen = {a.key for a in merged.setdefault(kind, [])}
        merged[kind] += [a for a in artifacts if a.key not in seen]
    try:
        return CacheArtifactManager.populate_caches(merged)
    except Exception as e:  # a full disk, say: what was written is checked, the rest compiles
        log.warning("could not load the compile cache %s: %s; compiling what is missing", where, e)
        return None


class CompileCache:
    """Inductor's cache dir and torch's portable artifacts under `local_dir` (node-local disk);
    with `remote` (the checkpoint Storage), the artifacts are also uploaded there (rank 0), signed
    with the run's key from `key_file` (trainer.compile_cache_key_file), and a copy read from there
    is loaded only with a valid signature. No usable key: the remote copy is neither read nor written."""

    def __init__(
        self, local_dir: str, remote=None, rank: int = 0, local_rank: int = 0, key_file: str | None = None
    ):
        self.local_dir, self.remote = os.path.abspath(local_dir), remote
        self.rank, self.local_rank = rank, local_rank
        self.loaded = 0  # artifacts handed to torch at start (0: cold)
        self.source = None  # "local" | "remote" | None
        self.key = self._run_key(key_file) if remote is not None else None

    def _run_key(self, key_file: str | None) -> bytes | None:
        try:
            if key_file is None:
                raise ValueError("no trainer.compile_cache_key_file")
            return cache_trust.run_key(cache_trust.load_secret(key_file), self.remote.url())
        except (OSError, ValueError) as e:
            log.warning("compile cache beside the checkpoints not used (neither read nor written): %s", e)
            return None

    def activate(self) -> None:
        """Before anything compiles: point inductor at the node-local dir, load saved artifacts:
        the node's copy (trusted as the node), else the store's (only with this run's HMAC)."""
        os.makedirs(self.local_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(self.local_dir, "inductor")
        for source, read, key in (("local", self._read_local, None), ("remote", self._read_remote, self.key)):
            blob, where = read()
            payload = None if blob is None else unwrap(blob, where, key)
            info = None if payload is None else load_artifacts(payload, where)
            if info is not None:
                self.loaded = sum(len(v) for v in info.artifacts.values())
                self.source = source
                log.info("compile cache: %d artifacts from %s", self.loaded, where)
                return

    def _read_local(self):
        path = os.path.join(self.local_dir, ARTIFACTS)
        try:  # a link, FIFO or dir there is not what save() wrote (and a FIFO would block the read)
            with open(regular(path, "compile cache"), "rb") as f:
                return f.read(), path
        except FileNotFoundError:
            return None, path
        except UnsafePath as e:
            log.warning("%s; compiling from scratch", e)
            return None, path

    def _read_remote(self):
        if self.key is None:  # no store copy, or no key to check it with
            return None, None
        folder, _, name = REMOTE.rpartition("/")
        try:
            size = self.remote.ls(folder).get(name)  # one listing: the kind of entry, not just its name
            if size is not None and size < 0:  # DIR or FOREIGN (a link loads whatever it points at)
                log.warning("compile cache %s is not a regular file; refused", self.remote.url(REMOTE))
            if size is None or size < 0:
                return None, None
            return self.remote.read_bytes(REMOTE), self.remote.url(REMOTE)
        except Exception as e:  # a store that fails now: a cold compile, not a failed start
            log.warning(
                "could not read the compile cache %s: %s; compiling from scratch", self.remote.url(REMOTE), e
            )
            return None, None

    def save(self) -> None:
        """After a compile: everything compiled in this process so far (and what was loaded)."""
        from goodput.storage.local import atomic_write

        try:
            out = torch.compiler.save_cache_artifacts()
            if out is None:
                return
            blob = wrap(out[0], self.key)
            if self.local_rank == 0:  # one writer per node: its ranks compile the same graphs
                atomic_write(os.path.join(self.local_dir, ARTIFACTS), blob, durable=False)
            if self.rank == 0 and self.key is not None:
                self.remote.write_bytes(REMOTE, blob)
        except Exception as e:  # a cache is an optimisation: never stop training for it
            log.warning("could not save the compile cache: %s", e)
