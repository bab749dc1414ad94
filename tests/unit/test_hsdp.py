"""parallel=hsdp (goodput.parallel.HSDP): the replica groups, the compose-time checks of
parallel.shard_size, and on 4 gloo ranks (2 replica groups x 2 shards, `mp.spawn`) the training
step and the checkpoint state on the 2-D mesh. The entry-point drills are in e2e/test_hsdp_runs.py."""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import check_config_change, compose_train, end_gloo_rank

from goodput.model import SmallCNN, model_sha256
from goodput.parallel import DDP, FSDP, HSDP, Single
from goodput.run.step import Step, StepGuard, StepOptions, make_ema

CPU = torch.device("cpu")
WORLD, SHARD = 4, 2  # 2 replica groups of 2 ranks: rank r at mesh (r // 2, r % 2)


def test_replica_groups_of_each_strategy(monkeypatch):
    """Which ranks hold one whole copy of the state (what a rescue needs), per strategy, with no
    collective: the rank itself (single, ddp), every rank (fsdp), the mesh's row (hsdp)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert Single().replica_groups(1) == [[0]]
    assert DDP().replica_groups(4) == [[0], [1], [2], [3]]
    assert FSDP().replica_groups(4) == [[0, 1, 2, 3]]
    h = HSDP(2)
    assert h.replica_groups(4) == [[0, 1], [2, 3]] and h.replica_group(3, 4) == [2, 3]
    assert h.shard_peers(1, 4) == [1, 3] and h.shard_peers(2, 4) == [0, 2]
    assert HSDP(3).replica_groups(6) == [[0, 1, 2], [3, 4, 5]]
    # a rescue is possible while one replica group is whole
    assert h.whole_replica({1, 2, 3}, 4) == [2, 3]
    assert h.whole_replica({0, 1, 3}, 4) == [0, 1]
    assert h.whole_replica({0, 3}, 4) is None
    assert DDP().whole_replica({1, 3}, 4) == [1]
    assert FSDP().whole_replica({0, 1, 2}, 4) is None and FSDP().whole_replica(range(4), 4) == [0, 1, 2, 3]
    # null: the ranks of one node (the launcher's LOCAL_WORLD_SIZE; one node without a launcher)
    assert HSDP().group_size(8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert HSDP().replica_groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]] and HSDP(2).group_size(8) == 2


def test_shard_size_is_checked_at_compose_time(monkeypatch):
    """A shard size that does not divide the world fails validation naming parallel.shard_size and
    both numbers; so does the node's size when shard_size is null. More ranks than CPU cores need
    parallel.oversubscribe=true, and never pass on GPUs."""
    from omegaconf import OmegaConf

    import goodput.config  # noqa: F401  (registers the schemas that compose needs)
    from goodput.parallel import LAUNCHER_ENV

    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    c = OmegaConf.to_container(
        compose_train(["paths.root=/x", "experiment=smoke", "parallel=hsdp"]), resolve=True
    )  # batch 16
    assert c["parallel"]["strategy"] == {"_target_": "goodput.parallel.HSDP", "shard_size": None}

    def hsdp(shard_size, n=4, oversubscribe=True):
        node = {"_target_": "goodput.parallel.HSDP", "shard_size": shard_size}
        return {"parallel": {"strategy": node, "shard_size": shard_size, "nproc_per_node": n,
                             "oversubscribe": oversubscribe}}  # fmt: skip

    for change, message in [
        (hsdp(2), None),
        (hsdp(None), None),  # one node of 4: one replica group (fsdp's layout), allowed
        (hsdp(1), None),  # whole replicas on every rank (ddp's layout), allowed
        (hsdp(3), "parallel.shard_size=3 does not divide the world size 4"),
        (hsdp(8), "parallel.shard_size=8 does not divide the world size 4"),
        (hsdp(0), "parallel.shard_size must be >= 1 or null, got 0"),
        (hsdp(2, oversubscribe=False),
         "parallel.nproc_per_node=4 is more processes than this machine can run (2 CPUs"),
        (hsdp(2, n=1), "goodput.parallel.HSDP shards parameters: it needs more than one process"),
    ]:  # fmt: skip
        check_config_change(c, change, message)

    # under a launcher: its world, and null = its ranks per node
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    over = {"trainer": {"global_batch_size": 24}}
    check_config_change(c, {**hsdp(None), **over}, "parallel.shard_size=4 (null: the 4 ranks of one node) "
                        "does not divide the world size 6")  # fmt: skip
    check_config_change(c, {**hsdp(3), **over}, None)

    # GPUs: oversubscription is no way around the number of devices
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_config_change(
        c, hsdp(2), "parallel.nproc_per_node=4 is more processes than this machine can run (2 GPUs)"
    )


# -- 4 gloo ranks ---------------------------------------------------------------------------------
def batches(n: int, batch: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 4, (batch,), generator=g))
        for _ in range(n)
    ]


def _init(rank: int, port: int):
    import torch.distributed as dist

    from goodput.parallel import Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    return Dist(rank, WORLD, rank, CPU, None)


def _hsdp_model(d, seed: int = 0, dtype=None, ema_decay: float | None = None):
    torch.manual_seed(seed)
    strategy = HSDP(SHARD)
    model = SmallCNN(num_classes=4, width=8)
    ema = make_ema(model, ema_decay) if ema_decay else None
    if ema is not None:  # as goodput.run.build does: copied before wrapping, laid out like the model
        ema.module = strategy.replica(ema.module, d, dtype)
    return strategy, strategy.wrap(model, d, dtype), ema


def _sgd_step(model, strategy, opts: StepOptions, **kw) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Step(model, opt, sched, strategy, opts, CPU, 16 // WORLD, **kw)


def _mine(x: torch.Tensor, rank: int) -> torch.Tensor:
    per = len(x) // WORLD
    return x[rank * per : (rank + 1) * per]


def _step_rank(rank: int, port: int, out: str) -> None:
    """One of 4 ranks: (a) fp32, 2 micro-batches, clipping, EMA, 2 steps; (b) fp16 with an inf
    planted in rank 3's gradient shard only; (c) bf16 parameters, clipped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    d = _init(rank, port)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    res = {}

    strategy, model, ema = _hsdp_model(d, ema_decay=0.5)
    early = []  # after each micro-step but the last: has any sharded gradient been reduced yet?
    spy = SimpleNamespace(
        in_step=lambda s: early.append(any(p.grad is not None for p in model.parameters())),
        after_forward=lambda s: None, in_update=lambda: None,
    )  # fmt: skip
    step = _sgd_step(
        model,
        strategy,
        StepOptions(micro_batch_size=2, clip_grad_norm=1e-3),
        ema=ema,
        guard=StepGuard(faults=spy),
    )
    for i, (x, y) in enumerate(batches(2)):
        step(_mine(x, rank), _mine(y, rank), i)
        if i == 0:
            res["norm"] = step.last_grad_norm
            res["shard_norm"] = torch.linalg.vector_norm(
                torch.cat([p.grad.to_local().flatten() for p in model.parameters()])
            )
    res["synced_early"] = early
    res["placements"] = sorted({str(p.placements) for m in (model, ema.module) for p in m.parameters()})
    res["model"] = get_model_state_dict(model, options=full)
    res["ema"] = get_model_state_dict(ema, options=full)
    dcp.save({"ema": get_model_state_dict(ema)}, checkpoint_id=os.path.join(out, "ema"))

    # (b) the sharded grad scaler: an inf on one rank's shard skips the step on every rank
    strategy, model, _ = _hsdp_model(d, dtype=torch.float16)
    before = [p.detach().to_local().clone() for p in model.parameters()]

    def plant():
        first = next(model.parameters())
        if rank == 3 and first.grad is not None:
            first.grad.to_local().view(-1)[0] = float("inf")

    step = _sgd_step(
        model, strategy, StepOptions(precision="16-mixed"), guard=StepGuard(wait_for_staging=plant)
    )
    x, y = batches(1)[0]
    step(_mine(x, rank), _mine(y, rank), 0)
    res["fp16_unchanged"] = all(
        torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters())
    )
    res["fp16_skipped"] = step.skipped_steps

    # (c) bf16: parameters all-gathered in bf16, gradients reduced in fp32, clipped over all shards
    strategy, model, _ = _hsdp_model(d, dtype=torch.bfloat16)
    step = _sgd_step(model, strategy, StepOptions(precision="bf16-mixed", clip_grad_norm=1e-3))
    res["bf16_loss"] = step(_mine(x, rank), _mine(y, rank), 0)
    res["bf16_norm"] = step.last_grad_norm
    res["bf16_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})

    # (d) the degenerate meshes: one group of 4 (fsdp's layout), 4 groups of 1 (ddp's), said in the log
    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("goodput.parallel").addHandler(handler)
    logging.getLogger("goodput.parallel").setLevel(logging.INFO)
    for size in (WORLD, 1):
        torch.manual_seed(0)
        strategy = HSDP(size)
        model = strategy.wrap(SmallCNN(num_classes=4, width=8), d)
        res[f"mesh_{size}"] = _mesh_of(model, strategy, rank)
        step = _sgd_step(model, strategy, StepOptions(clip_grad_norm=1e-3))
        step(_mine(x, rank), _mine(y, rank), 0)
        res[f"norm_{size}"] = step.last_grad_norm
    res["notes"] = notes
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    end_gloo_rank()


def _mesh_of(model, strategy, rank: int) -> dict:
    """The mesh the parameters live on, as this rank sees it: its shape and dim names, the ranks of
    its `shard` and `replicate` groups, the strategy's own replica group and shard peers (what a
    rescue counts on), and each parameter's (whole, local) first dim."""
    import torch.distributed as dist

    mesh = next(model.parameters()).device_mesh
    return {
        "shape": tuple(mesh.shape), "names": tuple(mesh.mesh_dim_names),
        "shard": dist.get_process_group_ranks(mesh.get_group("shard")),
        "replicate": dist.get_process_group_ranks(mesh.get_group("replicate")),
        "replica_group": strategy.replica_group(rank, WORLD),
        "shard_peers": strategy.shard_peers(rank, WORLD),
        "rows": [(p.shape[0], p.to_local().shape[0]) for p in model.parameters()],
    }  # fmt: skip


def _unsharded_reference(steps: int):
    """The same training on one process, the whole global batch: (first step's norm, final weights)."""
    from goodput.parallel import Single

    torch.manual_seed(0)
    model = SmallCNN(num_classes=4, width=8)
    step = _sgd_step(model, Single(), StepOptions(clip_grad_norm=1e-3))
    norms = []
    for i, (x, y) in enumerate(batches(steps)):
        step(x, y, i)
        norms.append(step.last_grad_norm)
    return norms[0], model.state_dict()


@pytest.mark.slow
def test_hsdp_step_clips_by_the_unsharded_norm_syncs_once_and_skips_together(tmp_path):
    """4 HSDP ranks: the norm clipped to is the whole gradient's of the global batch (each shard
    counted once, not once per replica group), the trained weights match one process's to float
    rounding, no gradient is reduced before the last micro-step, the EMA is sharded like the model
    and reads back whole from its DCP shards, an inf in one rank's shard skips the fp16 step on
    every rank, and bf16 parameters keep fp32 master weights and gradients. The degenerate meshes
    (one group of 4, four groups of 1) are those meshes (shape, groups, each parameter's shards: not
    square, so a mesh with its dims swapped shows), clip by the same norm, and the log names them."""
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    from goodput.parallel import free_port

    mp.spawn(_step_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    norm, weights = _unsharded_reference(2)

    for g in got:  # every rank clips by the same, unsharded norm
        assert torch.allclose(g["norm"], norm, rtol=1e-5), (g["norm"], norm)
        assert not torch.allclose(g["shard_norm"], norm, rtol=1e-2)  # a shard's norm is another number
        assert g["synced_early"] == [False, False]  # one micro-step each step ran without gradient sync
        assert g["placements"] == ["(Replicate(), Shard(dim=0))"]  # model and EMA alike
        assert g["fp16_unchanged"] and g["fp16_skipped"] == 1  # rank 3's inf skipped every rank's step
        assert g["bf16_dtypes"] == ["torch.float32"] and torch.isfinite(g["bf16_loss"])
        assert torch.allclose(g["bf16_norm"], norm, rtol=0.05), (g["bf16_norm"], norm)
        assert torch.allclose(g["norm_4"], norm, rtol=1e-5) and torch.allclose(g["norm_1"], norm, rtol=1e-5)
    # the meshes themselves, not square: 4 ranks in one replica group (sharded 4 ways), then 4
    # replica groups of one rank (whole parameters on each); the rescue's groups are the mesh's rows
    for r, g in enumerate(got):
        one, four = g["mesh_4"], g["mesh_1"]
        assert (one["shape"], one["names"]) == ((1, 4), ("replicate", "shard"))
        assert one["shard"] == one["replica_group"] == [0, 1, 2, 3] and one["replicate"] == [r]
        assert one["shard_peers"] == [r]
        assert (four["shape"], four["names"]) == ((4, 1), ("replicate", "shard"))
        assert four["shard"] == four["replica_group"] == [r] and four["replicate"] == [0, 1, 2, 3]
        assert four["shard_peers"] == [0, 1, 2, 3]
        assert all(whole == local for whole, local in four["rows"])  # every rank holds all of it
    rows = [g["mesh_4"]["rows"] for g in got]
    for i, (whole, _) in enumerate(rows[0]):  # each parameter's rows held once, across the 4
        assert sum(r[i][1] for r in rows) == whole
    mesh = "hsdp: {} replica group(s) x {} shard(s) (mesh replicate x shard): "
    assert got[0]["notes"] == [
        mesh.format(1, 4) + "one replica group, the layout of parallel=fsdp",
        mesh.format(4, 1) + "shard_size 1, whole replicas on every rank, the layout of parallel=ddp",
    ]
    assert got[1]["notes"] == []  # rank 0 says it
    for k, v in weights.items():  # accumulation and the 2-level reduction: rounding only
        gap = ((got[0]["model"][k] - v).abs().max() / v.abs().max()).item()
        assert gap < 1e-5, (k, gap)

    ema = make_ema(SmallCNN(num_classes=4, width=8), 0.5)
    sd = {"ema": {k: torch.zeros_like(v) for k, v in ema.state_dict().items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ema"), no_dist=True)
    assert sd["ema"].keys() == got[0]["ema"].keys() and got[0]["ema"]["n_averaged"].item() == 2
    for k, v in got[0]["ema"].items():
        assert torch.equal(sd["ema"][k], v), k


def _adamw_app(d, seed: int):
    """An HSDP model (AdamW, EMA) and the AppState a worker checkpoints, after one step."""
    from goodput.checkpoint import AppState

    strategy, model, ema = _hsdp_model(d, seed=seed, ema_decay=0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    app = AppState(model, opt, d.rank)
    app.register_module("ema", ema)
    return strategy, model, opt, ema, app


def _optim_full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return osd.get("state", {})


def _ckpt_rank(rank: int, port: int, out: str) -> None:
    """One of 4 ranks: save a trained HSDP state through each backend and load it into a fresh one;
    load a one-process checkpoint into HSDP; then replica group 0 (rank 0: the store's host) dies
    and group 1 writes its shards through its own group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from goodput.checkpoint import BACKENDS

    d = _init(rank, port)
    pg = dist.new_group(backend="gloo")  # the checkpoint group (async saves run on it)
    strategy, model, opt, ema, app = _adamw_app(d, seed=0)
    x, y = batches(1)[0]
    torch.nn.functional.cross_entropy(model(_mine(x, rank)), _mine(y, rank)).backward()
    opt.step()
    ema.update_parameters(model)
    want = {"model": model_sha256(model), "ema": model_sha256(ema.module), "optim": _optim_full(model, opt)}
    res = {"want": want}
    for name, cls in BACKENDS.items():
        backend, where = cls(), os.path.join(out, name)
        backend.save(app.state_dict(backend.options), where, rank, WORLD, pg).result()
        backend.close()
        dist.barrier()
        _, m2, o2, e2, app2 = _adamw_app(d, seed=1)  # other initial weights
        sd = backend.prepare_load(app2.template(backend.options, WORLD), where)
        backend.load(sd, where)
        app2.apply(sd, backend.options, step=1)
        res[name] = {"model": model_sha256(m2), "ema": model_sha256(e2.module), "optim": _optim_full(m2, o2)}

    _, m3, o3, _, app3 = _adamw_app(d, seed=1)  # written by one process (tests/unit: the parent)
    reader = BACKENDS["dcp_sync"]()
    sd = reader.prepare_load(app3.template(reader.options, 1), os.path.join(out, "one"))
    reader.load(sd, os.path.join(out, "one"))
    app3.apply(sd, reader.options, step=1)
    res["from_one"] = model_sha256(m3)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))

    # The rescue case: replica group 0 is lost (the TCP store's host among it), group 1 is whole.
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()  # every pid file is written
    group = strategy.whole_replica({2, 3}, WORLD)
    if rank not in group:
        os._exit(0)
    for r in set(range(WORLD)) - set(group):
        _wait_dead(os.path.join(out, f"pid{r}"))
    dcp.save(app.state_dict(StateDictOptions()), checkpoint_id=os.path.join(out, "rescue"),
             process_group=strategy.replica_pg)  # fmt: skip
    os._exit(0)  # no teardown: the default group has lost half its ranks


def _wait_dead(pid_file: str, timeout: float = 60) -> None:
    with open(pid_file) as f:
        pid = int(f.read())
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "State:\tZ" in f.read():
                    return  # exited, not yet reaped by mp.spawn
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"rank with pid {pid} did not exit")


def _read_dcp(path, prefix: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from goodput.checkpoint.backends import SafeFileSystemReader

    md = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()
          if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}  # fmt: skip
    dcp.load(sd, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    return {k[len(prefix) :]: v for k, v in sd.items()}


def _chunks_cover_once(path) -> None:
    """Every tensor of a DCP checkpoint is stored exactly once: its chunks tile it with no repeat."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from goodput.checkpoint.backends import SafeFileSystemReader

    md = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    for k, m in md.items():
        if isinstance(m, TensorStorageMetadata):
            offsets = [tuple(c.offsets) for c in m.chunks]
            assert len(offsets) == len(set(offsets)), (k, offsets)
            assert sum(torch.Size(c.sizes).numel() for c in m.chunks) == m.size.numel(), k


@pytest.mark.slow
def test_hsdp_checkpoints_through_each_backend_and_a_whole_replica_group_saves_alone(tmp_path):
    """4 HSDP ranks: torch_save (the full state gathered on rank 0), dcp_sync and dcp_async each
    restore the model, EMA and optimizer state exactly into a differently initialised HSDP model; a
    one-process DCP checkpoint loads into HSDP; DCP stores each shard once, not once per replica
    group. With replica group 0 gone (the TCP store's host in it), group 1 writes its shards through
    its own gloo group (HSDP.replica_pg), and they read back as the whole model and optimizer."""
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from goodput.checkpoint import AppState
    from goodput.parallel import free_port

    torch.manual_seed(5)  # the one-process checkpoint the ranks load
    one = SmallCNN(num_classes=4, width=8)
    opt = torch.optim.AdamW(one.parameters(), lr=0.01)
    torch.nn.functional.cross_entropy(one(batches(1)[0][0]), batches(1)[0][1]).backward()
    opt.step()
    app = AppState(one, opt, 0)
    app.register_module("ema", make_ema(one, 0.9))
    dcp.save(app.state_dict(StateDictOptions()), checkpoint_id=str(tmp_path / "one"), no_dist=True)

    mp.spawn(_ckpt_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    want = got[0]["want"]
    for name in ("torch_save", "dcp_sync", "dcp_async"):
        r = got[0][name]
        assert r["model"] == want["model"] and r["ema"] == want["ema"], name
        assert r["optim"].keys() == want["optim"].keys() and r["optim"], name
        for k, v in want["optim"].items():
            assert all(torch.equal(r["optim"][k][s], v[s]) for s in v), (name, k)
    assert got[0]["from_one"] == model_sha256(one)
    assert all(g["want"]["model"] is None for g in got[1:])  # the digest is rank 0's

    for name in ("dcp_sync", "dcp_async"):
        _chunks_cover_once(tmp_path / name)
    weights = SmallCNN(num_classes=4, width=8)
    weights.load_state_dict(_read_dcp(tmp_path / "dcp_sync", "model."))
    assert model_sha256(weights) == want["model"]  # the full unsharded state: the same definition

    assert sorted(os.listdir(tmp_path / "rescue")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    _chunks_cover_once(tmp_path / "rescue")
    weights.load_state_dict(_read_dcp(tmp_path / "rescue", "model."))
    assert model_sha256(weights) == want["model"]
    optim = _read_dcp(tmp_path / "rescue", "optim.state.")
    for k, v in want["optim"].items():
        for s, t in v.items():
            assert torch.equal(optim[f"{k}.{s}"], t), (k, s)
