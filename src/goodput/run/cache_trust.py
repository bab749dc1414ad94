"""What a compile cache must prove before torch gets it: who wrote it, and that it is only torch's.

torch's portable cache artifacts are code: inductor's and AOTAutograd's entries are pickled graphs and
generated Python/C++ that run when a compile finds them, and `populate_cache` writes each artifact to
a path built from its key (`os.path.join(cache_dir, key)` for an autotune entry: an absolute key is
any file on the machine, a `.pth` in site-packages runs at the next Python start). A copy uploaded
beside the checkpoints (`trainer.compile_cache_upload`) is therefore accepted only when both hold:

- **This run's job wrote it** (`sign`/`verify`): an HMAC-SHA256 over the blob's header and payload,
  keyed by a secret that never goes to the store (`trainer.compile_cache_key_file`, 0600, created on
  first use) and bound to the run (the checkpoint dir's URL). A party who can write the checkpoint
  dir but cannot read the key file cannot forge or re-key a blob. A digest in a commit record would
  not do: commits are unsigned, and whoever writes the store can write a matching one.
- **It holds only what torch writes here** (`check_artifacts`, local copies too): the artifact types
  a training run produces (inductor, aot_autograd, autotune), each key in the exact shape torch gives
  it, and the path torch would write it to inside inductor's cache dir. The types this template
  never writes (pgo: dynamo's pickled profile, keyed by torch.compiler.config.job_id; precompile)
  are refused.

The node-local copy (`trainer.compile_cache_dir`) is as trusted as the node: it is not required to
carry a valid HMAC (inductor's own cache dir next to it is loaded unchecked anyway), but its
artifacts pass `check_artifacts`. docs/security.md says what an attacker with which access can do.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat

from goodput.untrusted import why_unsafe

log = logging.getLogger(__name__)

# The keys torch 2.14 gives the artifacts of a training run (torch/_inductor/cache_key.py):
# base32 of a sha256, lower case, 51 characters, behind a prefix; an autotune entry is named by the
# directory of its Triton kernel (that kernel's code hash, characters 1-2) and a hex sha256.
_B32 = "[a-z2-7]"
KEY_SHAPES = {
    "inductor": re.compile(f"f{_B32}{{51}}"),  # FX_GRAPH_CACHE_KEY_STRATEGY
    "aot_autograd": re.compile(f"a{_B32}{{51}}"),  # AOTAUTOGRAD_CACHE_PREFIX + COMPACT_CACHE_KEY_STRATEGY
    "autotune": re.compile(f"{_B32}{{2}}/[0-9a-f]{{64}}\\.best_config"),  # AutotuneCache, CUDA only
}
SECRET_BYTES = 32
_CONTEXT = b"goodput compile cache v1\n"


def _torch_paths() -> dict:
    """Where each artifact type's populate_cache writes a key, as torch computes it."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {
        "inductor": FxGraphCache._get_tmp_dir_for_key,  # then a file named by the content's hash
        "aot_autograd": AOTAutogradCache._get_tmp_dir_for_key,
        "autotune": lambda key: os.path.join(cache_dir(), key),  # AutotuneCacheArtifact.populate_cache
    }


def check_artifacts(batches: list) -> str | None:
    """Why the (type, [artifact]) batches are not what torch writes for a training run in this cache,
    or None when they are. Each artifact's key has its type's exact shape, and the path torch would
    write it to is a plain path below inductor's cache dir (TORCHINDUCTOR_CACHE_DIR)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root, where = os.path.realpath(cache_dir()), _torch_paths()
    for kind, artifacts in batches:
        if kind not in KEY_SHAPES:
            return f"artifact type {kind!r} (a training run writes only {sorted(KEY_SHAPES)})"
        for a in artifacts:
            if not isinstance(a.key, str) or not KEY_SHAPES[kind].fullmatch(a.key):
                return f"{kind} artifact key {str(a.key)[:120]!r} is not a key torch makes"
            path = os.path.realpath(where[kind](a.key))
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if why_unsafe(rel):
                return f"{kind} artifact {a.key!r} would be written to {path}, outside {root}"
    return None


def key_file_problem(key_file: str, checkpoint_dir: str) -> str | None:
    """Why `key_file` cannot keep the compile cache's secret from whoever writes `checkpoint_dir`:
    it must be a local path, outside the checkpoint dir (compose-time check, goodput.config)."""
    if "://" in key_file:
        return f"trainer.compile_cache_key_file must be a local path, got {key_file!r}"
    if "://" in checkpoint_dir and not checkpoint_dir.startswith("file://"):
        return None
    ckpt = os.path.realpath(checkpoint_dir.removeprefix("file://"))
    key = os.path.realpath(key_file)
    if os.path.commonpath([ckpt, key]) == ckpt:
        return (
            f"trainer.compile_cache_key_file={key_file} is inside checkpoint.dir={checkpoint_dir}: "
            "whoever can write the checkpoints could replace the key that vouches for the compile cache"
        )
    return None


def load_secret(path: str) -> bytes:
    """The secret in `path`, created there (32 random bytes, hex, mode 0600, in a 0700 directory)
    when missing; concurrent creators agree (a hard link publishes the one whole file). Refused
    (OSError naming the file) unless it is a regular file of this user that nobody else may read
    or write, holding at least 32 bytes."""
    if not os.path.exists(path):
        _create(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(
                f"{path}: the compile cache's key must be a regular file of this user with mode 0600 "
                f"or 0400 (found mode {stat.filemode(st.st_mode)}, uid {st.st_uid})"
            )
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < SECRET_BYTES:
        raise PermissionError(
            f"{path}: the compile cache's key holds {len(data)} bytes, want >= {SECRET_BYTES}"
        )
    return data


def _create(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process published one first: theirs is the key
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def run_key(secret: bytes, run: str) -> bytes:
    """The key of one run (its checkpoint dir's URL): a blob signed for one run fails in another."""
    return hmac.new(secret, _CONTEXT + run.encode(), hashlib.sha256).digest()


def sign(key: bytes, header: bytes, payload: bytes) -> str:
    return hmac.new(key, header + b"\n" + payload, hashlib.sha256).hexdigest()


def verify(key: bytes, header: bytes, payload: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(sign(key, header, payload), mac)
