"""The training step (goodput.run.step), in-process: accumulation, clipping, fp16 loss scaling and its
skipped steps, EMA, and the step's state through every checkpoint backend. The kill drills through
the entry point are in test_step_drills.py."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
from helpers import check_config_change, compose_train, end_gloo_rank, manager

from goodput.checkpoint import BACKENDS, AppState
from goodput.checkpoint.state import decode, encode
from goodput.model import SmallCNN
from goodput.parallel import Single
from goodput.run.step import Step, StepOptions, make_ema

CPU = torch.device("cpu")


class Recording(Single):
    """The single-process strategy, counting the micro-steps run without gradient sync."""

    def __init__(self):
        self.no_sync_calls = 0

    def no_sync(self, model):
        self.no_sync_calls += 1
        return super().no_sync(model)


def make_step(opts: StepOptions, seed: int = 0, batch: int = 16, strategy=None, lr: float = 0.1):
    torch.manual_seed(seed)
    model = SmallCNN(num_classes=4, width=8)
    if opts.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = make_ema(model, opts.ema_decay) if opts.ema_decay is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Step(model, opt, sched, strategy or Single(), opts, CPU, batch, ema=ema)


def batches(n: int, batch: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 4, (batch,), generator=g))
        for _ in range(n)
    ]


def params(step: Step) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def rel_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp(min=1e-12)).item() for x, y in zip(a, b))


def test_accumulation_trains_the_whole_batch_step():
    """4 micro-batches of 4 (gradients accumulated, synced once) == one batch of 16, to float
    rounding: the loss is each micro-batch's share of the batch mean."""
    whole, accum = make_step(StepOptions()), make_step(StepOptions(micro_batch_size=4), strategy=Recording())
    assert accum.n_micro == 4
    for i, (x, y) in enumerate(batches(3)):
        lw, la = whole(x, y, i), accum(x, y, i)
        assert torch.allclose(lw, la, rtol=1e-6, atol=0)
    gap = rel_gap(params(accum), params(whole))
    assert gap < 1e-5, gap
    assert not same(params(accum), params(make_step(StepOptions())))  # it trained at all
    assert accum.strategy.no_sync_calls == 3 * 3  # all micro-steps but the last, every step
    with pytest.raises(
        ValueError, match=re.escape("trainer.micro_batch_size=5 must divide the per-rank batch 16")
    ):
        make_step(StepOptions(micro_batch_size=5))


def test_clipping_scales_to_the_total_norm():
    s = make_step(StepOptions(clip_grad_norm=0.05), lr=1.0)
    ref = make_step(StepOptions(), lr=1.0)
    x, y = batches(1)[0]
    s(x, y, 0)
    # the same step by hand: the unclipped gradients, their total norm, the clipped SGD update
    ref.optimizer.zero_grad()
    torch.nn.functional.cross_entropy(ref.model(x), y).backward()
    grads = [p.grad for p in ref.model.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    assert norm > 0.05  # so clipping acts
    assert torch.allclose(s.last_grad_norm, norm, rtol=1e-6)
    assert s.metrics()["train/grad_norm"] == pytest.approx(norm.item(), rel=1e-6)
    coef = 0.05 / (norm + 1e-6)
    for p, q, g in zip(s.model.parameters(), params(make_step(StepOptions())), grads):
        assert torch.allclose(p.detach(), q - g * coef, rtol=1e-5, atol=1e-7)


def test_fp16_overflow_skips_the_step_and_the_scaler_state_resumes():
    """A scale so large that the fp16 backward overflows: the scaler skips the optimizer step and
    halves the scale. Stopped after that step and resumed from the step's state dict, the run goes
    on exactly as the uninterrupted one; without the scaler's state it does not."""
    opts = StepOptions(precision="16-mixed", micro_batch_size=8, clip_grad_norm=1.0)
    data = batches(6)

    def fresh():  # at 2**20 this model's fp16 backward overflows; at 2**19 not always
        s = make_step(opts)
        s.scaler.load_state_dict({**s.scaler.state_dict(), "scale": 2.0**20})
        return s

    a = fresh()
    before = params(a)
    a(*data[0], 0)
    assert same(params(a), before) and a.skipped_steps == 1  # skipped: the weights did not move
    assert a.scaler.get_scale() == 2.0**19
    for i, (x, y) in enumerate(data[1:], 1):
        a(x, y, i)
    assert a.skipped_steps > 1 and not same(params(a), before)

    b = fresh()
    b(*data[0], 0)
    b(*data[1], 1)
    saved = (
        copy.deepcopy(b.model.state_dict()),
        copy.deepcopy(b.optimizer.state_dict()),
        encode(b.state_dict()),
    )
    for keep_scaler in (True, False):
        c = make_step(opts, seed=5)
        c.model.load_state_dict(saved[0])
        c.optimizer.load_state_dict(saved[1])
        if keep_scaler:
            c.load_state_dict(decode(saved[2]))
        for i, (x, y) in enumerate(data[2:], 2):
            c(x, y, i)
        assert same(params(c), params(a)) == keep_scaler
        assert (c.skipped_steps == a.skipped_steps) == keep_scaler


FP16 = StepOptions(precision="16-mixed")


@pytest.mark.parametrize(
    "field, value",
    [("scale", float("nan")), ("scale", float("inf")), ("scale", 0.0), ("scale", -1.0), ("scale", "1"),
     ("_growth_tracker", -1), ("_growth_tracker", 1.5), ("growth_factor", float("nan")),
     ("backoff_factor", 0.0), ("growth_interval", 0)],
)  # fmt: skip
def test_a_forged_scaler_state_is_refused_naming_the_field(field, value):
    """#34: a GradScaler state with `scale: NaN` from a checkpoint made every step skip. Refused
    before anything is applied (ValueError: the restore falls back to the previous commit)."""
    s = make_step(FP16)
    live = s.scaler.state_dict()
    forged = {"scaler": {**live, field: value}, "skipped_steps": 0}
    with pytest.raises(ValueError, match=re.escape(f"scaler.{field}={value!r}")):
        s.load_state_dict(decode(encode(forged)))  # as a checkpoint holds it (JSON)
    assert s.scaler.state_dict() == live
    with pytest.raises(ValueError, match=re.escape("skipped_steps=-2")):
        s.load_state_dict({"scaler": live, "skipped_steps": -2})


def test_skipped_steps_are_counted_whatever_the_scale():
    """A NaN scale skips every step and never backs off (NaN * 0.5 is NaN): comparing the scale
    before and after counted none. Counted where it happens now: the optimizer did not run."""
    s = make_step(FP16)
    torch.amp.GradScaler.load_state_dict(s.scaler, {**s.scaler.state_dict(), "scale": float("nan")})
    before = params(s)
    for i, (x, y) in enumerate(batches(3)):
        s(x, y, i)
    assert same(params(s), before) and s.skipped_steps == 3
    assert s.metrics()["train/skipped_steps"] == 3
    ok = make_step(FP16)
    ok(*batches(1)[0], 0)
    assert ok.skipped_steps == 0  # a step the optimizer took is not a skipped one


def test_a_commit_with_a_forged_scale_falls_back_to_the_previous_one(tmp_path, dist1):
    """The refusal at restore: the commit is intact but its state is not a state training can
    continue from, so it is skipped (named, with the field) and the previous commit loads."""
    s = make_step(FP16)
    app = AppState(s.model, s.optimizer, rank=0)
    app.register("step", s)
    mgr = manager(tmp_path, "dcp_sync", dist1)
    s(*batches(1)[0], 0)
    mgr.save(1, app)
    good = s.state_dict()
    s.scaler.state_dict = lambda: {**good["scaler"], "scale": float("nan")}  # what a forger writes
    mgr.save(2, app)
    mgr.wait()
    r = make_step(FP16, seed=3)
    rapp = AppState(r.model, r.optimizer, rank=0)
    rapp.register("step", r)
    rec, skipped = mgr.restore(rapp, mgr.committed())
    assert rec["step"] == 1 and r.state_dict() == good
    assert len(skipped) == 1 and "step-000000002" in skipped[0] and "scaler.scale=nan" in skipped[0]
    mgr.close()


def test_ema_follows_the_weights_from_its_start_step():
    decay, every, start = 0.8, 2, 3
    s = make_step(StepOptions(ema_decay=decay, ema_every_n_steps=every, ema_start_step=start))
    expected = None
    for i, (x, y) in enumerate(batches(8)):
        s(x, y, i)
        done = i + 1
        if done > start and done % every == 0:  # steps 4, 6, 8
            w = params(s)
            expected = w if expected is None else [decay * e + (1 - decay) * p for e, p in zip(expected, w)]
    assert s.ema.n_averaged.item() == 3
    got = [p.detach() for p in s.ema.module.parameters()]
    assert rel_gap(got, expected) < 1e-6
    assert rel_gap(got, params(s)) > 1e-3  # an average, not a copy of the last weights
    assert s.eval_module("ema") is s.ema.module and s.eval_module("model") is s.model
    with pytest.raises(ValueError, match="trainer.eval_on=ema needs trainer.ema_decay"):
        make_step(StepOptions()).eval_module("ema")


def test_channels_last_and_bf16_train():
    s = make_step(StepOptions(precision="bf16-mixed", channels_last=True))
    before = params(s)
    loss = s(*batches(1)[0], 0)
    assert torch.isfinite(loss) and not same(params(s), before)
    assert s.model.blocks[0][0].weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_scaler_and_ema_state_round_trip_through_each_backend(tmp_path, dist1, backend):
    """fp16 GradScaler state (scale, growth tracker, skipped steps) and the EMA tensors come back
    exactly from torch_save, dcp_sync and dcp_async."""
    opts = StepOptions(precision="16-mixed", ema_decay=0.9, micro_batch_size=8)

    def app_of(step):
        app = AppState(step.model, step.optimizer, rank=0)
        app.register("step", step)
        app.register_module("ema", step.ema)
        return app

    s = make_step(opts)
    s.scaler.load_state_dict({**s.scaler.state_dict(), "scale": 2.0**20})  # skipped steps, then good ones
    for i, (x, y) in enumerate(batches(4)):
        s(x, y, i)
    want = s.state_dict()
    assert want["skipped_steps"] >= 1 and want["scaler"]["_growth_tracker"] >= 1
    mgr = manager(tmp_path, backend, dist1)
    mgr.save(4, app_of(s))
    mgr.wait()

    r = make_step(opts, seed=7)  # other weights, a fresh scaler
    assert r.state_dict() != want
    got, skipped = mgr.restore(app_of(r), mgr.committed())
    assert got["step"] == 4 and skipped == []
    assert r.state_dict() == want
    assert r.ema.n_averaged.item() == s.ema.n_averaged.item() == 4
    for p, q in zip(r.ema.module.parameters(), s.ema.module.parameters()):
        assert torch.equal(p, q)
    mgr.close()


def test_bad_step_config_fails_at_validation_naming_the_key():
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(compose_train(["paths.root=/x", "experiment=smoke"]), resolve=True)  # batch 16
    DDP2 = {"strategy": {"_target_": "goodput.parallel.DDP"}, "nproc_per_node": 2}
    FSDP2 = {"strategy": {"_target_": "goodput.parallel.FSDP"}, "nproc_per_node": 2}
    for change, message in [
        ({"trainer": {"precision": "fp8"}}, "trainer.precision must be 32|bf16-mixed|16-mixed"),
        ({"trainer": {"micro_batch_size": 0}}, "trainer.micro_batch_size must be > 0 or null"),
        ({"trainer": {"micro_batch_size": 3}}, "micro_batch_size=3 must divide the per-rank batch 16"),
        ({"trainer": {"micro_batch_size": 8}, "parallel": DDP2}, None),
        ({"trainer": {"micro_batch_size": 16}, "parallel": DDP2},
         "trainer.micro_batch_size=16 must divide the per-rank batch 8"),
        ({"trainer": {"clip_grad_norm": -1.0}}, "trainer.clip_grad_norm must be > 0 or null"),
        ({"trainer": {"ema_decay": 1.0}}, "trainer.ema_decay must be in (0, 1) or null"),
        ({"trainer": {"eval_on": "ema"}}, "trainer.eval_on=ema needs trainer.ema_decay"),
        ({"trainer": {"eval_on": "ema", "ema_decay": 0.9, "ema_start_step": 12}},  # smoke: max_steps 12
         "the EMA's first update would be at step 13"),
        ({"trainer": {"eval_on": "ema", "ema_decay": 0.9, "ema_start_step": 10, "ema_every_n_steps": 5}},
         "the EMA's first update would be at step 15"),
        ({"trainer": {"eval_on": "ema", "ema_decay": 0.9, "ema_start_step": 8, "ema_every_n_steps": 5}},
         None),  # first update at 10
        ({"trainer": {"ema_decay": 0.9, "ema_start_step": 12}}, None),  # eval_on=model: EMA a by-product
        ({"trainer": {"channels_last": True}, "parallel": FSDP2},
         "trainer.channels_last=true with parallel.strategy goodput.parallel.FSDP"),
    ]:  # fmt: skip
        check_config_change(c, change, message)


def _fsdp_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: an FSDP2-sharded model and EMA, one accumulated, clipped step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from goodput.parallel import FSDP, Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    d = Dist(rank, 2, rank, CPU, None)
    torch.manual_seed(0)
    model = SmallCNN(num_classes=4, width=8)
    ema = make_ema(model, 0.5)
    ema.module = FSDP().replica(ema.module, d)
    model = FSDP().wrap(model, d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step = Step(
        model, opt, sched, FSDP(), StepOptions(micro_batch_size=4, clip_grad_norm=1e-3), CPU, 8, ema=ema
    )
    for i, (x, y) in enumerate(batches(2)):  # the global batch of 16; this rank's half
        step(x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8], i)
        if i == 0:
            shard_norm = torch.linalg.vector_norm(
                torch.cat([p.grad.to_local().flatten() for p in model.parameters()])
            )
            norm = step.last_grad_norm
    full = get_model_state_dict(ema, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dcp.save({"ema": get_model_state_dict(ema)}, checkpoint_id=out)  # sharded, as the DCP backends save it
    if rank == 0:
        torch.save({"norm": norm, "shard_norm": shard_norm, "ema": full}, os.path.join(out, "rank0.pt"))
    end_gloo_rank()


@pytest.mark.slow
def test_fsdp_clips_by_the_unsharded_norm_and_its_ema_reshards(tmp_path):
    """2 FSDP2 ranks: the norm clipped to is the norm of the whole (unsharded) gradient of the
    global batch, not of a rank's shard; the sharded EMA, read back on one process, is the EMA."""
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    from goodput.parallel import free_port

    mp.spawn(_fsdp_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)

    ref = make_step(StepOptions(clip_grad_norm=1e-3), lr=0.1)
    x, y = batches(2)[0]
    ref.optimizer = torch.optim.SGD(ref.model.parameters(), lr=0.1)  # the same optimizer as the ranks
    torch.nn.functional.cross_entropy(ref.model(x), y).backward()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref.model.parameters()]))
    assert torch.allclose(got["norm"], norm, rtol=1e-5), (got["norm"], norm)
    assert not torch.allclose(got["shard_norm"], norm, rtol=1e-2)  # one shard's norm is another number

    ema = make_ema(SmallCNN(num_classes=4, width=8), 0.5)
    sd = {"ema": {k: torch.zeros_like(v) for k, v in ema.state_dict().items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path), no_dist=True)
    assert sd["ema"].keys() == got["ema"].keys() and got["ema"]["n_averaged"].item() == 2
    for k, v in got["ema"].items():
        assert torch.equal(sd["ema"][k], v), k


@pytest.mark.parametrize("backend", ["torch_save", "dcp_sync"])
def test_ema_switched_on_at_a_relaunch_starts_from_the_restored_weights(tmp_path, dist1, backend, caplog):
    plain = make_step(StepOptions())
    plain(*batches(1)[0], 0)
    app = AppState(plain.model, plain.optimizer, rank=0)
    app.register("step", plain)
    mgr = manager(tmp_path, backend, dist1)
    mgr.save(1, app)
    mgr.wait()

    s = make_step(StepOptions(ema_decay=0.9), seed=3)
    app = AppState(s.model, s.optimizer, rank=0)
    app.register("step", s)
    app.register_module("ema", s.ema)
    got, skipped = mgr.restore(app, mgr.committed())
    assert got["step"] == 1 and skipped == []
    assert "the checkpoint has no 'ema'" in caplog.text
    assert same(params(s), params(plain)) and s.ema.n_averaged.item() == 0
    s(*batches(2)[1], 1)  # the first update copies the weights
    assert same([p.detach() for p in s.ema.module.parameters()], params(s))
    mgr.close()


@pytest.mark.parametrize("backend", ["torch_save", "dcp_sync"])
def test_a_checkpoint_from_before_the_step_best_and_early_stopping_parts_resumes(
    tmp_path, dist1, backend, caplog
):
    """A run upgraded mid-way: its checkpoints have no extra.step / best / early_stopping. Those parts
    are optional (a warning each, their fresh state kept); a required part missing still fails, named."""
    from goodput.monitor import Best, EarlyStopping

    old = make_step(StepOptions())
    old(*batches(1)[0], 0)
    app = AppState(old.model, old.optimizer, rank=0)  # what an older goodput saved: no new parts
    mgr = manager(tmp_path, backend, dist1)
    mgr.save(1, app)
    mgr.wait()

    s = make_step(StepOptions(precision="16-mixed"), seed=3)
    best, early = Best("val/loss", None), EarlyStopping(2, "val/loss", 0.0, None)
    app = AppState(s.model, s.optimizer, rank=0)
    app.register("step", s, missing="fresh scaler")
    app.register("best", best, missing="best starts over")
    app.register("early_stopping", early, missing="counter from zero")
    got, skipped = mgr.restore(app, mgr.committed())
    assert got is not None and got["step"] == 1 and skipped == []
    assert same(params(s), params(old))
    for name in ("step", "best", "early_stopping"):
        assert f"the checkpoint has no '{name}'" in caplog.text
    assert (best.step, early.bad, s.skipped_steps) == (None, 0, 0)

    app = AppState(s.model, s.optimizer, rank=0)
    app.register("step", s)  # required: the restore fails, naming the entry
    got, skipped = mgr.restore(app, mgr.committed())
    assert got is None and len(skipped) == 1 and "extra.step" in skipped[0]
    mgr.close()
