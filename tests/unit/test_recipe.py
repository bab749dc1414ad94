"""The recipe's seam, in-process: the new groups rename no run, each switch changes what is trained,
randomness in a researcher's own code is a function of (seed, epoch, index) or (seed, step), a
code edit is never continued silently, and the config refuses what cannot work. The kill + resume
drills (scripts/check.py) are in e2e/test_recipe_runs.py."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from helpers import PY_RANDOM_AUGMENT, REPO, compose_train, run_job_here
from omegaconf import OmegaConf

from goodput.config import ConfigError, validate
from goodput.data.sampler import batch_seed
from goodput.recipe.batch import MixUpCutMix


def name(*overrides: str) -> str:
    return OmegaConf.to_container(compose_train(["paths.root=/x", *overrides]), resolve=True)["run"]["name"]


def test_the_new_groups_rename_no_run():
    """Runs named before task and batch_augment existed keep their names: a group added at its
    neutral default (and a class moved into the recipe) changes no digest."""
    assert name() == "demo-ce4cc8a0"  # the default job's name before this change
    assert name("experiment=smoke") == "smoke-c004ded2"
    same = ["task=classification", "task.loss.label_smoothing=0.0", "batch_augment=none",
            "model._target_=goodput.model.SmallCNN"]  # fmt: skip
    assert {name("experiment=smoke", o) for o in same} == {"smoke-c004ded2"}
    other = [
        "task.loss.label_smoothing=0.1",
        "batch_augment=mixup",
        "batch_augment=cutmix",
        "task=multilabel",
    ]
    assert len({name("experiment=smoke", o) for o in other} | {"smoke-c004ded2"}) == len(other) + 1


PARTS = ["seed=3", "task.loss.label_smoothing=0.2", "batch_augment=mixup", "batch_augment=cutmix",
         "augment=ta_wide", "augment=randaugment", "optim.norm_weight_decay=0.0",
         "optim.bias_weight_decay=0.0", "data.repeated_augment=2", "data.train_crop_size=12"]  # fmt: skip


def test_each_recipe_switch_changes_what_is_trained(tmp_path, one_process):
    """Each part of the recipe trains another model (config only): label smoothing, MixUp and
    CutMix (which differ from each other), the augment presets, weight decay by parameter kind,
    repeated augmentation, the training crop."""
    shas = {}
    for i, o in enumerate(PARTS):
        summary, _ = run_job_here(
            tmp_path / str(i), "seed=3", o, "trainer.max_steps=3", "optim.optimizer.weight_decay=0.1"
        )
        shas[o] = summary["model_sha256"]
    assert len(set(shas.values())) == len(PARTS), shas


def test_python_and_numpy_randomness_in_a_transform_is_exact_at_any_worker_count(tmp_path, one_process):
    """A transform of your own drawing from `random` and `np.random` gives the same model with 0 and
    2 data workers (seeded per sample from (seed, epoch, index) in whichever process loads it), and
    it does act (another model than without it)."""
    common = ("trainer.max_steps=4", "augment=none")
    shas = [
        run_job_here(tmp_path / f"w{n}", *common, PY_RANDOM_AUGMENT, f"data.num_workers={n}")[0][
            "model_sha256"
        ]
        for n in (0, 2)
    ]
    plain = run_job_here(tmp_path / "plain", *common)[0]["model_sha256"]
    assert shas[0] == shas[1] != plain


def test_the_batch_transform_is_seeded_by_step_and_leaves_the_step_streams_alone(tmp_path, one_process):
    """Trainer.batch mixes with torch's generator seeded from (seed, step): the same batch at the
    same step mixes the same, at another step otherwise, and the process's stream the step draws
    from (dropout) does not move."""
    from goodput.run import build

    run_job_here(tmp_path, "batch_augment=mixup_cutmix", "trainer.max_steps=2")
    captured = {}
    original = build.Trainer.batch

    def spy(self, batch, step):
        torch.manual_seed(123)
        before = torch.get_rng_state()
        out = original(self, batch, step)
        captured.setdefault("unmoved", torch.equal(before, torch.get_rng_state()))
        again = original(self, batch, step)
        captured.setdefault("same", all(torch.equal(a, b) for a, b in zip(out, again)))
        other = original(self, batch, step + 1)
        captured.setdefault("other", not torch.equal(out[0], other[0]))
        return out

    build.Trainer.batch = spy
    try:
        run_job_here(tmp_path / "b", "batch_augment=mixup_cutmix", "trainer.max_steps=1")
    finally:
        build.Trainer.batch = original
    assert captured == {"unmoved": True, "same": True, "other": True}


def test_mixing_is_the_same_on_any_number_of_ranks():
    """Each rank's part of the mixed global batch is what one process computes for those samples:
    pairs of neighbours never cross an (even) rank slice, and the coefficient and box come from
    (seed, step) alone."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.nn.functional.one_hot(torch.arange(8) % 3, 3).float()

    def mixed(t, x, y):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(batch_seed(7, 5))
            return t(x, y)

    for t in (MixUpCutMix(mixup_alpha=0.2), MixUpCutMix(cutmix_alpha=1.0), MixUpCutMix(0.2, 1.0)):
        whole = mixed(t, x, y)
        for r in range(2):  # two ranks, four samples each
            part = mixed(t, x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4])
            assert all(torch.equal(a[4 * r : 4 * r + 4], b) for a, b in zip(whole, part))
        assert not torch.equal(whole[0], x) and torch.allclose(whole[1].sum(1), torch.ones(8))


def test_what_cannot_work_is_refused_before_any_work():
    c = OmegaConf.to_container(compose_train(["paths.root=/x", "experiment=smoke"]), resolve=True)
    mix, task, ck = c["batch_augment"], c["task"], c["checkpoint"]
    ce = "torch.nn.CrossEntropyLoss"
    for change, message in [
        ({"batch_augment": {**mix, "mixup_alpha": 0.2}, "trainer": {**c["trainer"], "global_batch_size": 15}},
         "trainer.global_batch_size=15 / world size 1 = 15 must be even"),
        ({"batch_augment": {**mix, "mixup_alpha": -1.0}}, "ValueError: batch_augment.mixup_alpha"),
        ({"task": {**task, "loss": {"_target_": ce, "label_smoothing": 2.0}}}, "task.loss: label_smoothing"),
        ({"task": {**task, "loss": {"_target_": ce, "label_smoothing": 0.3}}}, None),
        ({"checkpoint": {**ck, "keep_best_by": "val/mAP"}}, "checkpoint.keep_best_by=val/mAP is not"),
    ]:  # fmt: skip
        if message is None:
            validate({**c, **change})
            continue
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate({**c, **change})
    multilabel = OmegaConf.to_container(
        compose_train(["paths.root=/x", "experiment=smoke", "task=multilabel"]), resolve=True
    )
    validate({**multilabel, "checkpoint": {**multilabel["checkpoint"], "keep_best_by": "val/mAP"}})


def test_multilabel_trains_evaluates_predicts_and_keeps_its_best(tmp_path, one_process, capsys):
    """task=multilabel from its own demo data: the best checkpoint by val/macro_f1, evaluate.py's F1
    and mAP, predict.py's labels per image (several, joined by ';')."""
    import runpy

    from goodput.run.progress import done_line

    summary, c = run_job_here(
        tmp_path, "task=multilabel", "trainer.max_steps=16", "trainer.eval_every_n_steps=8",
        "checkpoint.keep_best_by=val/macro_f1", "trainer.global_batch_size=32",
    )  # fmt: skip
    assert {"val/macro_f1", "val/micro_f1", "val/mAP", "val/accuracy"} <= set(summary["val"])
    last = done_line(summary)  # the job's last line names the task's metrics, not accuracy alone
    assert f"mAP {summary['val']['val/mAP']:.4g}" in last and "macro_f1 " in last and "class/" not in last
    assert summary["best_step"] in (8, 16) and summary["best_value"] == pytest.approx(
        summary["val"]["val/macro_f1"] if summary["best_step"] == 16 else summary["best_value"]
    )
    ckpt = summary["checkpoint_dir"]
    evaluate = runpy.run_path(str(REPO / "scripts" / "evaluate.py"))["main"]
    assert evaluate([ckpt, "--no-mlflow", "--json"]) == 0
    printed = capsys.readouterr().out
    assert '"val/mAP"' in printed and '"val/macro_f1"' in printed
    predict = runpy.run_path(str(REPO / "scripts" / "predict.py"))["main"]
    images = sorted((tmp_path / "remote" / "data").glob("multilabel-*/val/*.jpg"))[:3]
    assert predict([ckpt, *map(str, images), "--top-k", "3"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "path,labels,top3" and len(rows) == 4
    assert all(len(r.split(",")[2].split(";")) == 3 for r in rows[1:])


def test_a_code_edit_is_refused_or_continued_on_purpose(tmp_path, one_process):
    """The code is part of the run: a relaunch after an edit (here of conf/, which the record covers
    as it does the package) is refused naming the file; run.allow_code_change=true continues it, and
    its next commit records the new code."""
    from goodput.checkpoint.commits import Commits
    from goodput.run import job, launch
    from goodput.storage.remote import Storage

    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)

    def relaunch(*overrides):
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose("train", overrides=["experiment=smoke", f"paths.root={tmp_path}", *overrides])
        c, ctx, lock = job.prepare(cfg, str(tmp_path / "run"), conf_dir=str(conf))
        try:
            return launch.launch(c, ctx), ctx
        finally:
            lock.release()

    relaunch("trainer.max_steps=4")
    with open(conf / "task" / "classification.yaml", "a") as f:
        f.write("# an edit\n")
    with pytest.raises(
        job.CodeChanged, match=r"conf/task/classification\.yaml changed.*run\.allow_code_change=true"
    ):
        relaunch("trainer.max_steps=6")
    summary, ctx = relaunch("trainer.max_steps=6", "run.allow_code_change=true")
    assert summary["steps"] == 6 and summary["resumed_from_steps"] == [4]
    newest = Commits(Storage(summary["checkpoint_dir"])).committed()[0]
    assert newest["step"] == 6 and newest["code"]["digest"] == ctx.code["digest"]


def test_epochs_are_counted_in_steps_before_the_run_and_name_nothing_else(tmp_path):
    """trainer.max_epochs (with trainer.max_steps=null) and optim.schedule.warmup_epochs become steps
    from the training split's size (x data.repeated_augment); the run is named by the epochs; both
    lengths at once, or a warm-up as long as the run, are refused naming both numbers."""
    from goodput.data.synthetic import make_dataset
    from goodput.run.job import epochs_to_steps

    def steps(*overrides):
        cfg = compose_train(["paths.root=/x", "experiment=smoke", "trainer.max_steps=null", *overrides])
        before = str(cfg.run.name)
        epochs_to_steps(cfg)
        c = OmegaConf.to_container(cfg, resolve=True)
        assert c["run"]["name"] == before  # (fixed from the epochs before the conversion)
        sched = c["optim"]["schedule"]
        return c["trainer"]["max_steps"], sched["warmup_steps"], sched["total_steps"]

    # smoke's demo data: 10 classes x 20 training images, global batch 16: 12 steps an epoch
    assert steps("trainer.max_epochs=2") == (24, 0, 24)
    assert steps("trainer.max_epochs=2", "data.repeated_augment=2") == (50, 0, 50)
    assert steps("trainer.max_epochs=3", "optim.schedule.warmup_epochs=0.5") == (36, 6, 36)
    epochs = ["experiment=smoke", "trainer.max_steps=null", "trainer.max_epochs=2"]
    assert name(*epochs) != name(*epochs, "optim.schedule.warmup_epochs=0.5")
    root = tmp_path / "data"  # data of your own: one listing of train/
    make_dataset(str(root), num_classes=2, train_per_class=12, val_per_class=1, image_size=16)
    assert steps("trainer.max_epochs=2", f"data.root={root}")[0] == 2 * (24 // 16)
    cfg = compose_train(["paths.root=/x", "experiment=smoke", "trainer.max_epochs=2"])
    with pytest.raises(ConfigError, match=r"trainer.max_epochs=2 and trainer.max_steps=12 are both set"):
        epochs_to_steps(cfg)
    cfg = compose_train(
        [*epochs[:2], "paths.root=/x", "trainer.max_epochs=1", "optim.schedule.warmup_epochs=1"]
    )
    epochs_to_steps(cfg)
    with pytest.raises(
        ConfigError, match=r"warmup_steps=12\) is as long as the run or longer \(total_steps=12"
    ):
        validate(OmegaConf.to_container(cfg, resolve=True))


def test_the_eval_view_travels_with_the_model(tmp_path, one_process):
    """data.val_resize_size / val_crop_size: evaluation resizes then center-crops, the model record
    carries both, and predict.py feeds the model the same view."""
    from torchvision.transforms import v2

    from goodput.inference import load

    views = ["data.val_resize_size=24", "data.val_crop_size=12", "data.train_crop_size=12"]
    summary, _ = run_job_here(tmp_path, "trainer.max_steps=2", *views)
    loaded = load(summary["checkpoint_dir"])
    assert (loaded.spec.image_size, loaded.spec.resize_size) == (12, 24)
    img = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)
    want = v2.CenterCrop(12)(v2.Resize(24, antialias=True)(img))
    assert torch.allclose(loaded.spec.transform()(img), (want.float() / 255 - 0.5) / 0.25, atol=1e-6)


def test_sync_batchnorm_is_refused_where_it_cannot_work():
    fsdp = ["parallel=fsdp", "parallel.nproc_per_node=2", "trainer.sync_batchnorm=true"]
    c = OmegaConf.to_container(compose_train(["paths.root=/x", "experiment=smoke", *fsdp]), resolve=True)
    with pytest.raises(
        ConfigError, match=r"trainer.sync_batchnorm=true with parallel.strategy goodput.parallel.FSDP"
    ):
        validate(c)


def test_fsdp_takes_its_blocks_from_the_model_and_refuses_a_model_without_any():
    """The shard plan comes with the model (the class's `shard_units`, SHARD_PLANS for torchvision's
    builders, or parallel.shard_units), never guessed from attribute names: a model without one is
    refused under fsdp before any work, naming it (built on the meta device: nothing allocated)."""
    import torchvision

    from goodput.recipe.models import SmallCNN, shard_plan, shard_units

    fsdp = ["paths.root=/x", "experiment=smoke", "parallel=fsdp", "parallel.nproc_per_node=2"]

    def check(*overrides):
        validate(OmegaConf.to_container(compose_train([*fsdp, *overrides]), resolve=True))

    check()  # SmallCNN: blocks.*
    check("model=resnet18")  # SHARD_PLANS: layer1..4
    with pytest.raises(ConfigError, match=r"model torchvision.models.densenet121 has no shard plan"):
        check("model._target_=torchvision.models.densenet121", "~model.width")
    check(
        "model._target_=torchvision.models.densenet121",
        "~model.width",
        "parallel.shard_units=[features.denseblock*]",
    )
    with pytest.raises(ConfigError, match=r"no shard plan matching parallel.shard_units=\['blocks.\*'\]"):
        check("model=resnet18", "parallel.shard_units=[blocks.*]")
    assert (
        len(shard_units(SmallCNN(4, 8), shard_plan(SmallCNN(4, 8), None))) == 3
    )  # the blocks, not their insides
    vit = torchvision.models.vit_b_16(num_classes=4)
    assert len(shard_units(vit, shard_plan(vit, "torchvision.models.vit_b_16"))) == 12
