"""A compiled run on the entry point, killed and relaunched, reads its compile cache and ends with
the uninterrupted model; a cache in the store whose entries were re-keyed is not used (real compiles
in fresh interpreters)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from helpers import run_train

from goodput.run import compiler


@pytest.mark.slow
def test_a_compiled_run_killed_and_relaunched_reads_its_cache(tmp_path):
    """Kill at step 6 (commit at 4), relaunch: the uninterrupted compiled model, and the second
    start compiled from its cache (inductor hits, no misses, artifacts loaded) in a fraction of the
    first start's compile. The reference shares the compile cache (warm: a compile is ~30 s here)."""
    cache = f"trainer.compile_cache_dir={tmp_path / 'compile_cache'}"
    # global batch 8: the 40 val images make 5 equal batches, one inference graph to compile
    args = ("trainer.compile=true", cache, "checkpoint=dcp_sync", "trainer.global_batch_size=8")
    p, _ = run_train(tmp_path / "a", *args, "fault.kill_at_step=6", expect_rc=-9, timeout=600)
    _, s = run_train(tmp_path / "a", *args, "fault.kill_at_step=6", timeout=600)
    _, ref = run_train(tmp_path / "ref", *args, timeout=600)
    assert s["resumed_from_steps"] == [4] and s["model_sha256"] == ref["model_sha256"]
    cold, warm = s["compile"]
    assert cold["attempt"] == 0 and cold["cache_artifacts_loaded"] == 0
    assert cold["fxgraph_cache_miss"] > 0 and cold["fxgraph_cache_hit"] == 0
    assert warm["attempt"] == 1 and warm["cache_artifacts_loaded"] > 0 and warm["cache_source"] == "local"
    assert warm["fxgraph_cache_miss"] == 0 and warm["fxgraph_cache_hit"] > 0
    assert warm["first_step_seconds"] < 0.5 * cold["first_step_seconds"], (cold, warm)
    assert s["recovery"]["per_restart"][0]["compile_seconds"] == warm["first_step_seconds"]
    g = s["goodput"]
    assert g["compile_seconds"] >= cold["first_step_seconds"] > g["productive_seconds"]
    print(f"cold {cold['first_step_seconds']}, warm {warm['first_step_seconds']}", file=sys.stderr)


# One node of a job: compile the named functions with the compile cache of checkpoint dir `ckpt`
# (signed with `key`), run them, save the cache; prints what it loaded and what each computed.
NODE = """
import json, sys, torch
from goodput.run.compiler import CompileCache
from goodput.storage.remote import Storage
node, ckpt, key, names = sys.argv[1:5]
fns = {"f": lambda x: x + 1.0, "g": lambda x: x * 3.0}
cache = CompileCache(node, Storage(ckpt), key_file=key)
cache.activate()
out = {n: torch.compile(fns[n])(torch.arange(4.0)).tolist() for n in names.split(",")}
cache.save()
print(json.dumps({"loaded": cache.loaded, "source": cache.source, **out}))
"""


def _node(tmp_path, node: str, names: str) -> tuple[dict, str]:
    args = [str(tmp_path / node), str(tmp_path / "ckpt"), str(tmp_path / "keys" / "k"), names]
    p = subprocess.run([sys.executable, "-c", NODE, *args], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _rekey(path) -> int:
    """What whoever can write the checkpoint dir does to an uploaded cache: swap the keys of two
    AOTAutograd entries (f's compiled graph now filed under g's key and back), re-serialize with
    torch's own writer, fix the envelope's size and sha256, keep the rest of its header."""
    from torch.compiler._cache import (
        CacheArtifactFactory,
        CacheArtifactManager,
        _deserialize_single_cache,
        _serialize_single_cache,
    )
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    magic, head, payload = path.read_bytes().split(b"\n", 2)
    head = json.loads(head)
    CacheArtifactManager._ensure_cache_artifacts_registered()
    ser, swapped = AppendingByteSerializer(serialize_fn=_serialize_single_cache), 0
    for kind, arts in AppendingByteSerializer.to_list(payload, deserialize_fn=_deserialize_single_cache):
        keys = [a.key for a in arts]
        if kind == "aot_autograd" and len(keys) == 2:
            keys, swapped = keys[::-1], 2
        ser.extend([(kind, [CacheArtifactFactory.create(kind, k, a.content) for k, a in zip(keys, arts)])])
    new = ser.to_bytes()
    head.update(sha256=hashlib.sha256(new).hexdigest(), size=len(new))
    path.write_bytes(magic + b"\n" + json.dumps(head).encode() + b"\n" + new)
    return swapped


@pytest.mark.slow
def test_a_rekeyed_entry_in_the_stores_cache_is_not_used(tmp_path):
    """Node A compiles f(x) = x + 1 and g(x) = x * 3 and uploads the cache; the store's writer swaps
    the two graphs' keys. A new node with an empty cache must still compute f, not g: the blob no
    longer carries this run's HMAC, so it compiles from scratch (before the fix: f returned g's
    values, silently)."""
    a, _ = _node(tmp_path, "node-a", "f,g")
    assert (a["f"], a["g"]) == ([1.0, 2.0, 3.0, 4.0], [0.0, 3.0, 6.0, 9.0])
    assert _rekey(tmp_path / "ckpt" / compiler.REMOTE) == 2
    b, err = _node(tmp_path, "node-b", "f")
    assert b["f"] == [1.0, 2.0, 3.0, 4.0], b
    assert (b["loaded"], b["source"]) == (0, None) and "no valid HMAC of this run's job" in err
