"""trainer.compile: checkpoints the same compiled or not, compile time in its own ledger category, a
compile cache that survives a kill (and refuses a corrupt one), in-process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import end_gloo_rank
from torch.distributed.checkpoint.state_dict import StateDictOptions

from goodput.checkpoint import AppState
from goodput.model import SmallCNN
from goodput.parallel import Single
from goodput.resilience.accounting import sync_point
from goodput.run import cache_trust, compiler
from goodput.run.cache_trust import KEY_SHAPES
from goodput.run.compiler import CompileCache, CompileClock
from goodput.storage.remote import Storage


def _app(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return AppState(model, opt, 0), opt


def _trained(seed: int, compiled: bool = False):
    torch.manual_seed(seed)
    m = SmallCNN(num_classes=10, width=8)
    if compiled:  # lazy: nothing compiles until it is called
        m = Single().compile(m, mode="default", dynamic=False)
    app, opt = _app(m)
    for p in m.parameters():  # momentum buffers exist only after a step
        p.grad = torch.randn_like(p)
    opt.step()
    return m, app


def test_a_compiled_models_checkpoint_loads_uncompiled_and_back():
    """Keys of the model and the optimizer state are those of the plain module (no `_orig_mod.`);
    a compiled run's state loads into an uncompiled one and back, tensor for tensor."""
    opts = StateDictOptions()
    plain, plain_app = _trained(0)
    comp, comp_app = _trained(1, compiled=True)
    assert list(comp.state_dict()) == list(plain.state_dict())
    sd_plain, sd_comp = plain_app.state_dict(opts), comp_app.state_dict(opts)
    assert list(sd_comp["model"]) == list(sd_plain["model"])
    assert list(sd_comp["optim"]["state"]) == list(sd_plain["optim"]["state"])
    # each way: a fresh pair, the source's state (cloned) loaded into the other, compared tensor by tensor
    for src_compiled in (True, False):
        plain, plain_app = _trained(0)
        comp, comp_app = _trained(1, compiled=True)
        src, dst = (comp_app, plain_app) if src_compiled else (plain_app, comp_app)
        saved = _clone(src.state_dict(opts))
        dst.apply(_clone(saved), opts, step=1)
        got = dst.state_dict(opts)
        for part in ("model", "optim"):
            flat_saved, flat_got = _flat(saved[part]), _flat(got[part])
            assert flat_saved.keys() == flat_got.keys()
            for k in flat_saved:
                assert torch.equal(flat_saved[k], flat_got[k]), (src_compiled, part, k)


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree.clone() if torch.is_tensor(tree) else tree


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in _flat(v, f"{prefix}{k}.").items()}
    return {prefix: tree}


def test_the_compile_clock_counts_torchs_compile_time_only(monkeypatch, caplog):
    """The loop subtracts `take()` from the step it timed: the growth of torch's top-level compile
    metrics (forward and backward), nothing else, 0 when compile is off, and the forward's only
    when dynamo compiled a graph: a frame it fell back to eager for (FSDP's root, #34) ran eagerly."""
    from torch._dynamo import utils

    metrics = {"_compile.compile_inner": [2.0], "backward._backward_impl": [], "compile_fx_inner": [9.0]}
    monkeypatch.setattr(utils, "compilation_time_metrics", metrics)
    monkeypatch.setitem(utils.counters, "stats", {"unique_graphs": 5})  # the process's, from before
    clock = CompileClock(True)
    metrics["_compile.compile_inner"].append(0.7)  # dynamo ran, compiled nothing: eager
    with caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
        assert clock.take() == 0.0
    assert "compiled no graph in the first step" in caplog.text
    metrics["_compile.compile_inner"].append(1.5)  # a recompile
    utils.counters["stats"]["unique_graphs"] += 1
    metrics["backward._backward_impl"].append(0.5)
    metrics["compile_fx_inner"].append(7.0)  # nested inside the two above: not counted again
    assert clock.take() == pytest.approx(2.0)
    assert clock.take() == 0.0 and clock.total == pytest.approx(2.0) and clock.graphs == 1
    assert CompileClock(False).take() == 0.0


def test_what_a_start_paid_is_the_clocks_total_and_its_caches_source():
    """The attempt record's `compile` (summary.json's `compile`, recovery's compile_seconds)."""
    cache = SimpleNamespace(loaded=3, source="remote", save=lambda: None)
    clock = CompileClock(True, cache)
    clock.total = 1.23456
    paid = clock.paid()
    assert paid["first_step_seconds"] == 1.2346 and paid["cache_artifacts_loaded"] == 3
    assert paid["cache_source"] == "remote" and "fxgraph_cache_hit" in paid and paid["graphs"] == 0
    assert CompileClock(False).paid() is None


def test_sync_point_synchronizes_only_on_cuda():
    assert sync_point(torch.device("cpu"))() is None
    sync = sync_point(torch.device("cuda", 0))
    assert sync.func is torch.cuda.synchronize and sync.args == (torch.device("cuda", 0),)


class FakeTorchCache:
    """torch's save of cache artifacts and our load, recorded (real artifacts need a compile)."""

    def __init__(self, monkeypatch, payload=b"compiled code"):
        self.payload, self.loaded = payload, []
        monkeypatch.setattr(torch.compiler, "save_cache_artifacts", self.save)
        monkeypatch.setattr(compiler, "load_artifacts", self.load)

    def save(self):
        return self.payload, None

    def load(self, blob, where=""):
        self.loaded.append(blob)
        from torch.compiler._cache import CacheInfo

        info = CacheInfo()
        info.artifacts["inductor"].append("key")
        return info


def test_the_cache_survives_in_the_local_dir_and_beside_the_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")  # restored after the test
    fake = FakeTorchCache(monkeypatch)
    remote, key = Storage(str(tmp_path / "ckpt")), str(tmp_path / "keys" / "k")
    first = CompileCache(str(tmp_path / "node1"), remote, key_file=key)
    first.activate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "node1" / "inductor")
    assert first.loaded == 0 and fake.loaded == []  # cold
    first.save()
    again = CompileCache(str(tmp_path / "node1"), None)  # a restart on the same node
    again.activate()
    assert (again.loaded, again.source, fake.loaded) == (1, "local", [b"compiled code"])
    elsewhere = CompileCache(str(tmp_path / "node2"), remote, key_file=key)  # a relaunch on a new node
    elsewhere.activate()
    assert (elsewhere.source, len(fake.loaded)) == ("remote", 2)
    assert CompileCache(str(tmp_path / "node3"), None).loaded == 0  # upload off: nothing to read


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda b: b"\x00" * 40, "no header"),
        (lambda b: b[:-3], "checksum mismatch"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
        (lambda b: b.replace(torch.__version__.encode(), b"0.0.1"), "written by torch 0.0.1"),
    ],
)
def test_a_damaged_cache_is_refused_with_a_warning(tmp_path, monkeypatch, caplog, damage, why):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    fake = FakeTorchCache(monkeypatch)
    CompileCache(str(tmp_path)).save()
    path = tmp_path / compiler.ARTIFACTS
    path.write_bytes(damage(path.read_bytes()))
    cache = CompileCache(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
        cache.activate()
    assert cache.loaded == 0 and fake.loaded == []  # never handed to torch
    assert why in caplog.text and str(path) in caplog.text


def test_a_blob_torch_cannot_read_is_ignored(tmp_path, monkeypatch, caplog):
    """Our envelope is intact, its payload is not torch's format: torch returns None (it checks its
    own checksum and logs), the cache counts as cold, training goes on."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    (tmp_path / compiler.ARTIFACTS).write_bytes(compiler.wrap(b"not torch's format"))
    cache = CompileCache(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
        cache.activate()
    assert cache.loaded == 0 and "torch cannot parse its artifacts" in caplog.text


def _key(prefix: str, name: str) -> str:
    """A key in the shape torch gives an inductor ("f") or AOTAutograd ("a") entry: 51 base32 characters."""
    return (prefix + name).ljust(52, "q")


def _artifact_payload(batches) -> bytes:
    """Bytes as save_cache_artifacts makes them after one save per batch (cumulative); each batch is
    (type, [(key, content)])."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    ser = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    for kind, items in batches:
        ser.extend([(kind, [CacheArtifactFactory.create(kind, k, content) for k, content in items])])
    return ser.to_bytes()


def test_every_saved_batch_is_loaded(tmp_path, monkeypatch):
    """Two compiles in one process (the first step, the first evaluation) save twice: the bytes hold
    two batches, and a new node must get both (torch's own load keeps only the last)."""
    import torch._inductor.codecache  # noqa: F401  (registers the inductor artifact type)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    train_fwd, train_bwd, eval_fwd = (_key("f", n) for n in ("trainfwd", "trainbwd", "evalfwd"))
    graphs = lambda *keys: ("inductor", [(k, b"graph " + k.encode()) for k in keys])  # noqa: E731
    payload = _artifact_payload([graphs(train_fwd, train_bwd), graphs(eval_fwd)])
    info = compiler.load_artifacts(payload)
    assert sorted(info.artifacts["inductor"]) == sorted([train_fwd, train_bwd, eval_fwd])
    for key in (train_fwd, eval_fwd):  # written where inductor's graph cache looks them up
        assert list((tmp_path / "inductor").rglob(f"*{key}*")), key


def test_a_linked_cache_is_refused_locally_and_beside_the_checkpoints(tmp_path, monkeypatch, caplog):
    """The cache is code that runs when loaded: a symbolic link in its place (to another run's blob,
    say) is not what this run saved, on the node or in the checkpoint dir."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    fake = FakeTorchCache(monkeypatch)
    CompileCache(str(tmp_path / "elsewhere")).save()  # a valid blob, not this run's
    blob = tmp_path / "elsewhere" / compiler.ARTIFACTS
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / compiler.ARTIFACTS).symlink_to(blob)
    (tmp_path / "ckpt" / "compile_cache").mkdir(parents=True)
    (tmp_path / "ckpt" / compiler.REMOTE).symlink_to(blob)
    cache = CompileCache(
        str(tmp_path / "node"), Storage(str(tmp_path / "ckpt")), key_file=str(tmp_path / "k")
    )
    with caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
        cache.activate()
    assert (cache.loaded, cache.source, fake.loaded) == (0, None, [])
    assert caplog.text.count("not a regular file") == 2


def _fsdp_compiled_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: the same FSDP2 model trained 2 steps eagerly and compiled (as
    parallel=fsdp trainer.compile=true compiles it), then one inference pass; what torch compiled."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from goodput.parallel import FSDP, Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    d = Dist(rank, 2, rank, torch.device("cpu"), None)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(2)
    ]
    got = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = FSDP().wrap(SmallCNN(num_classes=4, width=8), d)
        if compiled:  # aot_eager: dynamo's graphs and AOTAutograd's backward, without inductor's C++ build
            FSDP().compile(model, backend="aot_eager", dynamic=False)
        clock = CompileClock(compiled)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:  # this rank's half of the global batch
            xs, ys = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            logits = model.eval()(data[0][0][:8])
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        got[compiled] = {"state": full, "logits": logits, "compile_seconds": clock.take()}
    got["graphs"] = int(counters["stats"]["unique_graphs"])
    got["graph_breaks"] = sum(counters["graph_break"].values())
    if rank == 0:
        torch.save(got, os.path.join(out, "rank0.pt"))
    end_gloo_rank()


@pytest.mark.slow
def test_compile_under_fsdp_compiles_graphs_and_trains_the_eager_model(tmp_path):
    """#34: parallel=fsdp trainer.compile=true exited 0 with dynamo falling back to eager (the root
    compiled whole: FSDP's hooks inside, no graph), while compile_seconds reported compile time.
    Now each unit's forward is compiled: graphs, no graph break, compile time counted, and the
    model after two steps is the eager FSDP model's within 1e-5 (aot_eager rounds as eager does)."""
    import torch.multiprocessing as mp

    from goodput.parallel import free_port

    mp.spawn(_fsdp_compiled_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert got["graphs"] >= 3 and got["graph_breaks"] == 0, got  # SmallCNN's 3 units (forward)
    assert got[True]["compile_seconds"] > 0 and got[False]["compile_seconds"] == 0.0
    eager, compiled = got[False]["state"], got[True]["state"]
    assert eager.keys() == compiled.keys()  # no `_orig_mod.`: the same checkpoint either way
    torch.manual_seed(0)
    init = SmallCNN(num_classes=4, width=8).state_dict()
    assert not torch.equal(init["head.weight"], eager["head.weight"])  # it trained
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-5, atol=1e-5, msg=k)
    torch.testing.assert_close(got[True]["logits"], got[False]["logits"], rtol=1e-5, atol=1e-5)


# -- the cache from the store is code: only this run's job may have written it ----------------------
def _forge(payload: bytes) -> bytes:
    """The envelope as whoever can write the checkpoint dir makes it: the header's sha256 is theirs to
    compute (and any "hmac" they like)."""
    head = {"torch": torch.__version__, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    head["hmac"] = "0" * 64
    return compiler.MAGIC + json.dumps(head).encode() + b"\n" + payload


# What an attacker files under torch's artifact types: torch's populate_cache builds each path from
# the key (`{sp}`: a site-packages dir, `.pth` files there run at the next Python start).
PTH = "import pathlib; pathlib.Path({mark!r}).write_text('ran')\n"
FORGED = {
    "autotune-absolute-pth": ("autotune", "{sp}/evil.pth", PTH),
    "autotune-climbing-pth": ("autotune", "../../site-packages/evil.pth", PTH),  # from <node>/inductor
    "inductor-climbing": ("inductor", "fx/../../../../../site-packages", "graph"),
    "aot_autograd-absolute": ("aot_autograd", "{sp}", "graph"),
    "pgo-pickle": ("pgo", "evil", "a pickle dynamo loads at the next compile"),
    "precompile-absolute": ("precompile", "{sp}/pkg", "a pickle"),
}


def _files(root) -> set:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("where", ["store", "store, signed by this run", "node"])
@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_cache_writes_nothing_and_runs_nothing(tmp_path, monkeypatch, caplog, case, where):
    """A blob in the checkpoint dir without this run's HMAC is never handed to torch; and no copy,
    signed or node-local, that holds an artifact torch would not write here (another type, a key of
    another shape, a path outside inductor's cache dir) is either: nothing is written anywhere and
    nothing runs, the start compiles from scratch."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    sp, mark = tmp_path / "site-packages", tmp_path / "ran"
    sp.mkdir()
    kind, key, content = FORGED[case]
    payload = _artifact_payload([(kind, [(key.format(sp=sp), content.format(mark=str(mark)).encode())])])
    remote = Storage(str(tmp_path / "ckpt"))
    cache = CompileCache(str(tmp_path / "node"), remote, key_file=str(tmp_path / "keys" / "k"))
    if where == "node":
        blob, at = _forge(payload), tmp_path / "node" / compiler.ARTIFACTS
    else:
        blob = compiler.wrap(payload, cache.key) if "signed" in where else _forge(payload)
        at = tmp_path / "ckpt" / compiler.REMOTE
    at.parent.mkdir(parents=True)
    at.write_bytes(blob)
    before = _files(tmp_path)
    with caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
        cache.activate()
    assert _files(tmp_path) == before  # nothing written: not in site-packages, not in the cache dir
    subprocess.run(
        [sys.executable, "-c", "import site, sys; site.addsitedir(sys.argv[1])", str(sp)], check=True
    )
    assert not mark.exists()  # and nothing ran
    assert (cache.loaded, cache.source) == (0, None)
    why = (
        "no valid HMAC"
        if where == "store"
        else "not a key torch makes"
        if kind in KEY_SHAPES
        else "artifact type"
    )
    assert why in caplog.text and str(at) in caplog.text, caplog.text


def test_only_a_copy_this_run_signed_is_read_from_the_store(tmp_path, monkeypatch, caplog):
    """Signed with another secret, signed for another run (its checkpoint dir), or unsigned: ignored
    with a warning; this run's own signed copy loads on a new node."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    fake = FakeTorchCache(monkeypatch)
    mine, other = Storage(str(tmp_path / "ckpt")), Storage(str(tmp_path / "other-run"))
    CompileCache(str(tmp_path / "a"), other, key_file=str(tmp_path / "k")).save()  # same secret, other run
    CompileCache(str(tmp_path / "b"), mine, key_file=str(tmp_path / "k2")).save()  # another secret
    blobs = {
        "other run": (tmp_path / "other-run" / compiler.REMOTE).read_bytes(),
        "other secret": (tmp_path / "ckpt" / compiler.REMOTE).read_bytes(),
        "unsigned": compiler.wrap(b"compiled code"),
    }
    for what, blob in blobs.items():
        (tmp_path / "ckpt" / compiler.REMOTE).write_bytes(blob)
        cache = CompileCache(str(tmp_path / "new-node" / what), mine, key_file=str(tmp_path / "k"))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
            cache.activate()
        assert (cache.loaded, fake.loaded) == (0, []), what
        assert "no valid HMAC of this run's job" in caplog.text, what
    CompileCache(str(tmp_path / "c"), mine, key_file=str(tmp_path / "k")).save()  # this run's job
    older = (tmp_path / "ckpt" / compiler.REMOTE).read_bytes()
    cache = CompileCache(str(tmp_path / "new-node" / "own"), mine, key_file=str(tmp_path / "k"))
    cache.activate()
    assert (cache.loaded, cache.source, fake.loaded) == (1, "remote", [b"compiled code"])
    fake.payload = b"more compiled code"
    CompileCache(str(tmp_path / "d"), mine, key_file=str(tmp_path / "k")).save()
    (tmp_path / "ckpt" / compiler.REMOTE).write_bytes(older)  # what the HMAC does not stop: a replay
    CompileCache(str(tmp_path / "new-node" / "replayed"), mine, key_file=str(tmp_path / "k")).activate()
    assert fake.loaded[-1] == b"compiled code"  # this run's own older graphs, nothing else


def test_the_key_is_created_private_and_an_unsafe_key_turns_the_store_copy_off(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    fake = FakeTorchCache(monkeypatch)
    key = tmp_path / "keys" / "compile_cache.key"
    secret = cache_trust.load_secret(str(key))
    assert oct(key.stat().st_mode & 0o777) == "0o600" and oct(key.parent.stat().st_mode & 0o777) == "0o700"
    assert cache_trust.load_secret(str(key)) == secret and len(secret) >= cache_trust.SECRET_BYTES
    remote = Storage(str(tmp_path / "ckpt"))
    CompileCache(str(tmp_path / "a"), remote, key_file=str(key)).save()
    uploaded = (tmp_path / "ckpt" / compiler.REMOTE).read_bytes()
    key.chmod(0o644)  # readable by others: anyone who can read it could sign a cache
    with caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
        cache = CompileCache(str(tmp_path / "b"), remote, key_file=str(key))
        cache.activate()
        fake.payload = b"other code"
        cache.save()
    assert cache.key is None and (cache.loaded, fake.loaded) == (0, [])
    assert "neither read nor written" in caplog.text and "mode -rw-r--r--" in caplog.text
    assert (tmp_path / "ckpt" / compiler.REMOTE).read_bytes() == uploaded  # not overwritten
    (tmp_path / "short").write_text("x")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(PermissionError, match="holds 1 bytes"):
        cache_trust.load_secret(str(tmp_path / "short"))
    (tmp_path / "link").symlink_to(key)
    with pytest.raises(OSError):  # a link is not the key file itself
        cache_trust.load_secret(str(tmp_path / "link"))
    if os.geteuid() == 0:  # (only root can give a file away)
        key.chmod(0o600)
        os.chown(key, os.geteuid() + 4242, -1)
        with pytest.raises(PermissionError, match=f"uid {os.geteuid() + 4242}"):
            cache_trust.load_secret(str(key))


def test_a_key_file_inside_the_checkpoint_dir_fails_at_validate(tmp_path):
    from helpers import compose_train
    from omegaconf import OmegaConf

    from goodput.config import ConfigError, validate

    over = [f"paths.root={tmp_path}", "trainer.compile=true", "trainer.compile_cache_upload=true"]
    c = OmegaConf.to_container(compose_train(over), resolve=True)
    validate(c)  # the default: <paths.root>/keys/, beside the checkpoints, not in them
    bad = {**c, "trainer": {**c["trainer"], "compile_cache_key_file": c["checkpoint"]["dir"] + "/k.key"}}
    with pytest.raises(ConfigError, match="trainer.compile_cache_key_file=.* is inside checkpoint.dir="):
        validate(bad)
    assert cache_trust.key_file_problem("s3://b/k", "/ckpt") is not None
    assert cache_trust.key_file_problem(str(tmp_path / "k"), "s3://b/ckpt") is None


def test_a_path_torch_would_write_outside_its_cache_dir_is_refused_whatever_the_key_shape(
    tmp_path, monkeypatch
):
    """The second check behind the key shapes: the path is computed with torch's own functions (so a
    torch that changed where it writes, or a looser shape, is still held to the cache dir)."""
    import re

    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(cache_trust, "KEY_SHAPES", dict.fromkeys(KEY_SHAPES, re.compile(".*", re.S)))
    CacheArtifactManager._ensure_cache_artifacts_registered()
    art = lambda kind, key: [(kind, [CacheArtifactFactory.create(kind, key, b"x")])]  # noqa: E731
    assert cache_trust.check_artifacts(art("inductor", _key("f", "ok"))) is None
    bad = [("autotune", "../evil.pth"), ("autotune", str(tmp_path / "x")), ("aot_autograd", "/abs")]
    for kind, key in [*bad, ("inductor", "fx/../../../../evil")]:
        assert "outside" in cache_trust.check_artifacts(art(kind, key)), (kind, key)


def test_a_store_or_disk_that_fails_while_the_cache_loads_costs_a_cold_compile_not_the_start(
    tmp_path, monkeypatch, caplog
):
    from torch.compiler._cache import CacheArtifactManager

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")
    remote, key = Storage(str(tmp_path / "ckpt")), str(tmp_path / "k")
    cache = CompileCache(str(tmp_path / "a"), remote, key_file=key)
    (tmp_path / "ckpt" / "compile_cache").mkdir(parents=True)
    payload = _artifact_payload([("inductor", [(_key("f", "x"), b"graph")])])
    (tmp_path / "ckpt" / compiler.REMOTE).write_bytes(compiler.wrap(payload, cache.key))

    def fail(*a, **kw):
        raise OSError("injected")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="goodput.run.compiler"):
        m.setattr(remote, "read_bytes", fail)  # the store
        cache.activate()
        m.undo()
        m.setattr(CacheArtifactManager, "populate_caches", fail)  # the node's disk
        cache.activate()
    assert (cache.loaded, cache.source) == (0, None)
    assert (
        "could not read the compile cache" in caplog.text
        and "could not load the compile cache" in caplog.text
    )
