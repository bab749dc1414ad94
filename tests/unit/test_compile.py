"""trainer.compile: checkpoints the same compiled or not, compile time in its own ledger category, a
compile cache that survives a kill (and refuses a corrupt one), in-process."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from goodput.checkpoint import AppState
from goodput.model import SmallCNN
from goodput.parallel import Single
from goodput.resilience.accounting import sync_point
from goodput.run import compiler
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

    def load(self, blob):
        self.loaded.append(blob)
        from torch.compiler._cache import CacheInfo

        info = CacheInfo()
        info.artifacts["inductor"].append("key")
        return info


def test_the_cache_survives_in_the_local_dir_and_beside_the_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-by-test")  # restored after the test
    fake = FakeTorchCache(monkeypatch)
    remote = Storage(str(tmp_path / "ckpt"))
    first = CompileCache(str(tmp_path / "node1"), remote)
    first.activate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "node1" / "inductor")
    assert first.loaded == 0 and fake.loaded == []  # cold
    first.save()
    again = CompileCache(str(tmp_path / "node1"), None)  # a restart on the same node
    again.activate()
    assert (again.loaded, again.source, fake.loaded) == (1, "local", [b"compiled code"])
    elsewhere = CompileCache(str(tmp_path / "node2"), remote)  # a relaunch on a new node
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
    assert cache.loaded == 0 and "torch could not read" in caplog.text


def _artifact_payload(batches) -> bytes:
    """Bytes as save_cache_artifacts makes them after one save per batch (cumulative)."""
    from torch.compiler._cache import CacheArtifactFactory, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    ser = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    for keys in batches:
        ser.extend(
            [("inductor", [CacheArtifactFactory.create("inductor", k, b"graph " + k.encode()) for k in keys])]
        )
    return ser.to_bytes()


def test_every_saved_batch_is_loaded(tmp_path, monkeypatch):
    """Two compiles in one process (the first step, the first evaluation) save twice: the bytes hold
    two batches, and a new node must get both (torch's own load keeps only the last)."""
    import torch._inductor.codecache  # noqa: F401  (registers the inductor artifact type)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    payload = _artifact_payload([["ftrainfwd", "ftrainbwd"], ["fevalfwd"]])
    info = compiler.load_artifacts(payload)
    assert sorted(info.artifacts["inductor"]) == ["fevalfwd", "ftrainbwd", "ftrainfwd"]
    for key in ("ftrainfwd", "fevalfwd"):  # written where inductor's graph cache looks them up
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
    cache = CompileCache(str(tmp_path / "node"), Storage(str(tmp_path / "ckpt")))
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
    dist.destroy_process_group()


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
