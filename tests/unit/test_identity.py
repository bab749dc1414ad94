"""Run identity: every key classified (in one table, the docs' table generated from it), the default
run name (experiment + digest of the identity keys), and what `prepare` decides from it: a new run
for a new config, a refusal naming each changed key for an explicit name, a longer run that says
what its LR does, the MLflow run's states (changed keys recorded, leftovers closed, failures FAILED)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO, make_app
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from goodput import identity
from goodput.config import SCHEMAS, Config
from goodput.errors import UserError
from goodput.parallel import LAUNCHER_ENV
from goodput.resilience.lock import RunLocked
from goodput.run import build, job
from goodput.run.schedule import lr_schedule

CONF = REPO / "conf"


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)


def composed(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["experiment=smoke", *overrides], return_hydra_config=hydra)


def name_of(*overrides: str) -> str:
    return OmegaConf.to_container(composed(*overrides), resolve=True)["run"]["name"]


# -- the classification ------------------------------------------------------------------------------
def schema_keys(schemas: dict) -> set[str]:
    """Every schema field as a dotted key, and the keys without a schema group (seed; the `_target_`
    nodes model, task, batch_augment: goodput.config.Config's untyped fields)."""
    out = {f.name for f in dataclasses.fields(Config) if f.name not in schemas}
    for group, schema in schemas.items():
        out |= {f"{group.replace('/', '.')}.{f.name}" for f in dataclasses.fields(schema)}
    return out


def unclassified(schemas: dict) -> list[str]:
    """Schema keys with neither a row of their own nor a `key.*` row (an open `_target_` node)."""
    return sorted(k for k in schema_keys(schemas) if k not in identity.KEYS and k not in identity.NODES)


def option_leaves() -> set[str]:
    """The keys of every option of every group, composed (what is under the open nodes included)."""
    out = set()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for f in sorted(CONF.rglob("*.yaml")):
            group = f.parent.relative_to(CONF).as_posix()
            if group == "." or group.split("/")[0] in ("hydra", "hparams_search"):
                continue
            cfg = compose("train", overrides=[f"{group}={f.stem}"])
            out |= {k for k, _ in identity.leaves(OmegaConf.to_container(cfg, resolve=False))}
    return out


def test_every_schema_key_and_every_option_key_is_classified():
    """A schema key without a row in goodput.identity.TABLE fails here: adding a key means deciding
    whether changing it makes another training run. Every key an option file composes is covered
    (by its row or its open node's), and every row names a key that exists."""
    assert unclassified(SCHEMAS) == []
    leaves = option_leaves()
    assert sorted(k for k in leaves if identity.classify(k) is None) == []
    schema = schema_keys(SCHEMAS)
    stale = [k for k in identity.KEYS if k not in schema and k not in leaves]
    stale += [k for k in identity.NODES if k not in schema]
    assert stale == [], "rows for keys no schema or option has"


def test_a_new_schema_key_without_a_row_is_caught():
    from goodput.run.config import TrainerConfig

    @dataclasses.dataclass
    class Planted(TrainerConfig):
        label_smoothing: float = 0.0
        """A new switch of the step."""

    assert unclassified({**SCHEMAS, "trainer": Planted}) == ["trainer.label_smoothing"]
    assert identity.is_identity("trainer.label_smoothing")  # unclassified at run time: a new run


def test_docs_config_md_has_the_table_of_the_code():
    page = (REPO / "docs" / "config.md").read_text()
    m = re.search(r"<!-- identity-table -->\n(.*?)\n<!-- /identity-table -->", page, re.S)
    assert m, "docs/config.md: no <!-- identity-table --> section"
    assert m.group(1) == identity.markdown_table(), "regenerate it: make docs"


# -- the name ------------------------------------------------------------------------------------------
def test_the_name_is_the_experiment_plus_the_digest_of_the_identity_keys():
    cfg = composed()
    assert cfg.run.name == f"smoke-{identity.digest(identity.keys(cfg))}"
    assert re.fullmatch(r"smoke-[0-9a-f]{8}", cfg.run.name)
    assert name_of("experiment=demo").startswith("demo-")


def test_existing_names_are_kept():
    """Run names are how a relaunch finds its checkpoints: a change to what is hashed must not rename
    an existing run. The smoke default's name, and the values behind the names of the demo data
    (`${paths.data_dir}` as written: paths.root may move) and of an absolute data.root or URL."""
    assert (
        name_of("experiment=demo") == "demo-ce4cc8a0"
    )  # the default job's name since before the recipe groups
    # (smoke's changed once, with what it trains: its schedule lost the warm-up longer than the run)
    cfg = composed()
    assert cfg.run.name == "smoke-c004ded2" and identity.digest(identity.keys(cfg)) == "c004ded2"
    assert identity.keys(cfg)["data.root"] == "${paths.data_dir}"
    for root in ("/data/flowers", "s3://bucket/flowers", "memory://flowers"):
        assert identity.keys(composed(f"data.root={root}"))["data.root"] == root


@pytest.mark.parametrize("key", ["data.root", "run.init_from"])
def test_a_relative_path_names_what_it_opens_from_this_directory(tmp_path, monkeypatch, key):
    """The job opens a relative data.root (run.init_from) from its working directory: the same
    command from two directories trains on two datasets (starts from two checkpoints), so it names
    two runs; each the run that the absolute path names."""
    names = {}
    for where in ("a", "b"):
        (tmp_path / where / "mine").mkdir(parents=True)
        monkeypatch.chdir(tmp_path / where)
        names[where] = name_of(f"{key}=mine")
        assert names[where] == name_of(f"{key}={tmp_path / where / 'mine'}")
        assert name_of(f"{key}=./mine/") == names[where]  # spelled otherwise, the same folder
    assert names["a"] != names["b"]
    monkeypatch.setenv("HOME", str(tmp_path / "a"))
    assert name_of(f"{key}='~/mine'") == names["a"]  # expanded as fsspec does


SAME_RUN = [
    "checkpoint=torch_save", "parallel=ddp", "data=remote", "fault.kill_at_step=3", "trainer.max_steps=99",
    "paths.root=/elsewhere", "mlflow.log_model=final", "data.num_workers=3", "trainer.eval_every_n_steps=5",
    "checkpoint.every_n_steps=7", "trainer.num_threads=2",
]  # fmt: skip
OTHER_RUN = [
    "model=resnet18", "model.width=16", "seed=1", "data.root=/data/flowers", "optim=adamw",
    "optim.optimizer.lr=0.01", "augment=none", "trainer.precision=bf16-mixed", "trainer.global_batch_size=32",
    "data.image_size=32", "data=shards", "optim.schedule.total_steps=12", "trainer.micro_batch_size=8",
    "demo_data.train_per_class=30", "optim/schedule=step",
]  # fmt: skip


def test_what_is_trained_decides_the_name_and_nothing_else_does():
    """Keys that may change between relaunches of one run keep its name (trainer.max_steps too: the
    schedule's `${trainer.max_steps}` counts as written); each key that changes what is trained
    gives another name (optim.schedule.total_steps=12 given explicitly too, although it equals
    max_steps: then raising max_steps no longer moves it)."""
    base = name_of()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):

        def name(o):
            cfg = compose("train", overrides=["experiment=smoke", *o.split()])
            return OmegaConf.to_container(cfg, resolve=True)["run"]["name"]

        assert {o: name(o) for o in SAME_RUN} == {o: base for o in SAME_RUN}
        others = {o: name(o) for o in OTHER_RUN}
    assert base not in others.values() and len(set(others.values())) == len(OTHER_RUN), others


# -- every identity row, one change each -------------------------------------------------------------------
# The identity rows of goodput.identity.TABLE, frozen here: reclassifying one (trainer.clip_grad_norm
# made "not what is trained", and docs/config.md regenerated as its test asks) fails this file until
# the list is edited too, in the same diff a reviewer reads.
IDENTITY_ROWS = [
    "augment.after_normalize.*", "augment.mean", "augment.std", "augment.train.*", "batch_augment.*",
    "data.dataset.*", "data.image_size", "data.repeated_augment", "data.root", "data.source.shuffle_block",
    "data.train_crop_size", "demo_data.image_size", "demo_data.kind",
    "demo_data.num_classes", "demo_data.seed", "demo_data.train_per_class", "demo_data.val_per_class",
    "model.*", "optim.bias_weight_decay", "optim.norm_weight_decay", "optim.optimizer.*", "optim.schedule.*",
    "optim.schedule._partial_", "optim.schedule._target_", "optim.schedule.min_lr_ratio",
    "optim.schedule.total_steps", "optim.schedule.warmup_epochs", "optim.schedule.warmup_steps",
    "run.init_from", "seed", "task.*", "trainer.clip_grad_norm", "trainer.ema_decay",
    "trainer.ema_every_n_steps", "trainer.ema_start_step", "trainer.global_batch_size",
    "trainer.micro_batch_size", "trainer.precision", "trainer.sync_batchnorm",
]  # fmt: skip
# Rows whose other values the job takes on CUDA only (torch's SyncBatchNorm)
NEEDS_CUDA = {"trainer.sync_batchnorm"}
# Identity rows with no valid value but their default: the frozen list alone guards them.
NO_OTHER_VALUE = {"optim.schedule._partial_": "the schedule is called with the optimizer: false builds none"}
# What each row changes, as (options composed first, key): under an open node (`.*`) representative
# keys per option file; a plain row its own key, in the smoke default unless BASE names options.
NODE_KEYS = {
    "model.*": [((), "model.width"), ((), "model._target_"),
                (("model=resnet18",), "model.zero_init_residual")],
    "task.*": [((), "task.loss.label_smoothing"), ((), "task.loss._target_"), ((), "task._target_")],
    "batch_augment.*": [((), "batch_augment.mixup_alpha"), ((), "batch_augment._target_"),
                        (("batch_augment=mixup_cutmix",), "batch_augment.switch_prob")],
    "data.dataset.*": [((), "data.dataset._target_")],
    "augment.train.*": [((), "augment.train.2.brightness"), (("augment=light",), "augment.train.0.scale"),
                        (("augment=none",), "augment.train")],
    "optim.optimizer.*": [((), "optim.optimizer.lr"), ((), "optim.optimizer.momentum"),
                          ((), "optim.optimizer._target_"),
                          (("optim=adamw",), "optim.optimizer.weight_decay")],
    "optim.schedule.*": [(("optim/schedule=step",), "optim.schedule.step_size")],
    "augment.after_normalize.*": [((), "augment.after_normalize")],
}  # fmt: skip
BASE = {
    "data.source.shuffle_block": ("data=shards",),
    "trainer.ema_every_n_steps": ("trainer.ema_decay=0.999",),
    "trainer.ema_start_step": ("trainer.ema_decay=0.999",),
}
# A valid value other than the default where its type gives none (null, a string, a list, a class, a
# key the option does not set); every other key gets one by its type (other_value).
VALUES = {
    "run.init_from": "/elsewhere/checkpoints/source",
    "trainer.precision": "bf16-mixed",
    "trainer.micro_batch_size": 8,
    "trainer.clip_grad_norm": 1.0,
    "trainer.ema_decay": 0.999,
    "demo_data.kind": "multilabel",
    "data.root": "/data/flowers",
    "augment.mean": [0.485, 0.456, 0.406],  # ImageNet's
    "augment.std": [0.229, 0.224, 0.225],
    "augment.train.0.scale": [0.5, 1.0],
    "augment.train": [{"_target_": "torchvision.transforms.v2.Resize", "size": [16, 16]}],
    "optim.norm_weight_decay": 0.0,
    "optim.bias_weight_decay": 0.0,
    "optim.schedule._target_": "helpers.warmup_constant",  # warmup_cosine's arguments
    "model._target_": "helpers.StochasticNet.build",  # SmallCNN's arguments
    "model.zero_init_residual": True,
    "task._target_": "goodput.recipe.task.Multilabel",
    "task.loss._target_": "torch.nn.BCEWithLogitsLoss",
    "batch_augment.mixup_alpha": 0.2,
    "batch_augment._target_": "torchvision.transforms.v2.Identity",
    "batch_augment.switch_prob": 0.25,
    "data.dataset._target_": "goodput.data.dataset.CsvManifest",
    "optim.optimizer._target_": "torch.optim.RMSprop",  # SGD's arguments
    "augment.after_normalize": [{"_target_": "torchvision.transforms.v2.RandomErasing"}],
    "optim.schedule.warmup_epochs": 0.5,  # (the job turns it into steps: epochs_to_steps)
}
# Keys a class does not take, dropped beside its change: each out of the digest already (not an
# identity key, null, or NEUTRAL), so the change stays that key's alone.
DROPPED = {
    "task._target_": ["task.top_k"],
    "task.loss._target_": ["task.loss.label_smoothing"],
    "batch_augment._target_": ["batch_augment.mixup_alpha", "batch_augment.cutmix_alpha"],
}


def other_value(key: str, default):
    """A valid value of `key` other than `default` (as resolved): VALUES's, else one by its type."""
    if key in VALUES:
        return VALUES[key]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default * 2 if default else 1
    if isinstance(default, float):
        return default / 2 if default else 0.1
    raise AssertionError(f"{key}: no value by type for {default!r}: give one in VALUES")


_bases: dict = {}


def base_config(options: tuple[str, ...]):
    if options not in _bases:
        _bases[options] = composed(*options)
    return _bases[options]


def test_the_identity_rows_are_the_frozen_list():
    assert sorted(k for k, ident, _ in identity.TABLE if ident) == IDENTITY_ROWS


@pytest.mark.parametrize("row", IDENTITY_ROWS)
def test_each_identity_key_changed_alone_names_another_run(row, monkeypatch):
    """Each identity key set to a valid value other than its default (validate() takes it) gives
    another default run name, and the digest's keys differ in that key alone (and the keys that say
    `${key}`): a row reclassified as "not what is trained" would keep the name, and a relaunch with
    the key changed would continue the other run."""
    from omegaconf import open_dict

    from goodput.config import validate
    from goodput.run.job import epochs_to_steps

    if row in NO_OTHER_VALUE:
        return
    for options, key in NODE_KEYS[row] if row.endswith(".*") else [(BASE.get(row, ()), row)]:
        base = base_config(options)
        value = other_value(key, OmegaConf.select(base, key, default=None))
        cfg = base.copy()
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
            for gone in DROPPED.get(key, []):
                parent, _, leaf = gone.rpartition(".")
                del OmegaConf.select(cfg, parent)[leaf]
        raw = dict(identity.leaves(OmegaConf.to_container(base)))
        follow, grew = {key}, True  # the keys that say `${key}`, or `${k}` of one that does
        while grew:
            more = {k for k, v in raw.items() if any(f"${{{f}}}" in str(v) for f in follow)} - follow
            follow, grew = follow | more, bool(more)
        differ = [k for k, _, _ in identity.differences(identity.keys(base), identity.keys(cfg))]
        alone = all(k == key or k.startswith(f"{key}.") or k in follow for k in differ)
        assert differ and alone, (key, value, differ)
        name = str(cfg.run.name)
        epochs_to_steps(cfg)  # as the job does before it resolves
        resolved = OmegaConf.to_container(cfg, resolve=True)
        assert name == resolved["run"]["name"] != base.run.name, (key, value)
        if row in NEEDS_CUDA:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        validate(resolved)  # a value the job takes


def test_the_paths_follow_the_name_and_an_explicit_name_is_kept():
    cfg = composed("paths.root=/r", hydra=True)
    name = cfg.run.name
    assert cfg.hydra.run.dir.startswith(f"/r/runs/{name}/")  # Hydra resolves it before the task runs
    assert (cfg.checkpoint.dir, cfg.checkpoint.staging_dir) == (
        f"/r/checkpoints/{name}",
        f"/r/staging/{name}",
    )
    explicit = composed("paths.root=/r", "run.name=mine", hydra=True)
    assert explicit.checkpoint.dir == "/r/checkpoints/mine" and "/runs/mine/" in explicit.hydra.run.dir


def test_hydra_registers_the_resolver_by_itself_without_torch():
    """hydra_plugins.goodput_config: Hydra's plugin discovery imports it, so any composition sees
    `${goodput.identity:}`; importing it pulls in no torch."""
    code = (
        "import sys\nfrom omegaconf import OmegaConf\nfrom hydra.core.plugins import Plugins\n"
        "assert not OmegaConf.has_resolver('goodput.identity')\nPlugins.instance()\n"
        "assert OmegaConf.has_resolver('goodput.identity')\nassert 'torch' not in sys.modules, 'torch'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]


# -- prepare: what a launch continues ------------------------------------------------------------------
class Store:
    """A paths.root and MLflow store in tmp, `prepare` on smoke configs there (the lock released, as
    a finished job leaves it), and commits written by the run's real checkpoint manager."""

    def __init__(self, tmp_path, dist):
        self.root, self.dist = tmp_path, dist
        self.uri = f"sqlite:///{tmp_path}/mlflow.db"
        self.client = MlflowClient(self.uri)

    def prepare(self, *overrides: str, release: bool = True):
        cfg = composed(f"paths.root={self.root}", f"mlflow.tracking_uri={self.uri}", "checkpoint=dcp_sync",
                       *overrides)  # fmt: skip
        c, ctx, lock = job.prepare(cfg, str(self.root / "run"))
        if release:
            lock.release()
        return c, ctx

    def commit(self, c, ctx, step: int, end: bool = True) -> None:
        """A commit of `step`; the last step's, with `end`, followed by the run's end (FINISHED), as
        the worker writes it."""
        # (the lock is released: these stand for commits the job wrote while it held it)
        mgr = build.checkpoint_manager(c, dataclasses.replace(ctx, lock_token=None), self.dist)
        mgr.save(step, make_app(step)[0])
        mgr.wait()
        if end and step >= c.trainer.max_steps:
            self.client.set_terminated(ctx.mlflow_run_id, "FINISHED")

    def runs(self) -> list:
        exp = self.client.get_experiment_by_name("goodput")
        return self.client.search_runs([exp.experiment_id]) if exp else []


@pytest.fixture
def store(tmp_path, dist1):
    return Store(tmp_path, dist1)


def test_an_unfinished_run_and_a_new_config_is_a_new_run(store):
    c, ctx = store.prepare()
    store.commit(c, ctx, 4)  # 4 of 12 steps
    c2, ctx2 = store.prepare("model.width=16")
    assert c2.run.name != c.run.name and c2.checkpoint.dir != c.checkpoint.dir
    assert ctx2.mlflow_run_id != ctx.mlflow_run_id
    assert os.listdir(c2.checkpoint.dir) == []  # nothing of the other run's weights
    c3, ctx3 = store.prepare("trainer.max_steps=20", "data=remote")  # the same run, relaunched otherwise
    assert c3.checkpoint.dir == c.checkpoint.dir and ctx3.mlflow_run_id == ctx.mlflow_run_id


def test_each_job_of_a_sweep_gets_its_own_run(store):
    """scripts/train.py passes a -m job's overrides as the suffix: a sweep over keys that are not
    identity keys (the same digest) still makes one run per job."""
    cfg = composed(f"paths.root={store.root}", f"mlflow.tracking_uri={store.uri}", "checkpoint=torch_save")
    c, ctx, lock = job.prepare(cfg, str(store.root / "run"), "checkpoint=torch_save")
    lock.release()
    assert c.run.name == f"{cfg.run.name}/checkpoint=torch_save"
    assert c.checkpoint.dir == f"{store.root}/checkpoints/{cfg.run.name}/checkpoint=torch_save"
    assert store.client.get_run(ctx.mlflow_run_id).info.run_name == c.run.name


def test_an_explicit_name_with_other_identity_keys_is_refused_naming_each(store, caplog):
    c, ctx = store.prepare()
    store.commit(c, ctx, 4)
    before = {r.info.run_id for r in store.runs()}
    with pytest.raises(job.IdentityChanged) as e:
        store.prepare(f"run.name={c.run.name}", "model.width=16", "optim.optimizer.lr=0.05")
    assert isinstance(e.value, UserError)  # scripts/train.py: one line, exit 2
    msg = str(e.value)
    assert f"(its commit {c.checkpoint.dir}/step-000000004)" in msg  # the step dir that decided
    assert "model.width (the run: 32, this launch: 16)" in msg
    assert "optim.optimizer.lr (the run: 0.1, this launch: 0.05)" in msg and "run.allow_config_change" in msg
    assert {r.info.run_id for r in store.runs()} == before  # no MLflow run opened
    # forced: continued, with a warning listing the keys, and the MLflow run says what changed
    with caplog.at_level(logging.WARNING):
        c2, ctx2 = store.prepare(
            f"run.name={c.run.name}", "optim.optimizer.lr=0.05", "run.allow_config_change=true"
        )
    assert (
        "continuing run" in caplog.text
        and "optim.optimizer.lr (the run: 0.1, this launch: 0.05)" in caplog.text
    )
    assert ctx2.mlflow_run_id == ctx.mlflow_run_id
    run = store.client.get_run(ctx.mlflow_run_id)
    assert (
        run.data.params["optim.optimizer.lr"] == "0.1"
        and run.data.params["changed.2.optim.optimizer.lr"] == "0.05"
    )
    assert run.data.tags["goodput.identity"] == ctx2.identity["digest"] != ctx.identity["digest"]
    # what rank 0's Tracker uploads as the run's identity.json (tests/unit/test_phases.py: uploaded)
    assert ctx2.identity["keys"]["optim.optimizer.lr"] == 0.05


@pytest.mark.parametrize("key", ["trainer.clip_grad_norm", "trainer.ema_decay", "run.init_from"])
def test_a_key_set_on_one_side_only_is_refused_naming_it(store, key):
    """A key null in the run is absent from its record: a relaunch that sets it (or a run that had it
    relaunched without it) differs in a key only one side holds, and is refused naming it, null on
    the other side; comparing only the keys both records hold would continue the run."""
    value = {"trainer.clip_grad_norm": 1.0, "trainer.ema_decay": 0.999}.get(key)
    if key == "run.init_from":  # a warm start's source: it must be there when the run starts
        src, src_ctx = store.prepare("run.name=source")
        store.commit(src, src_ctx, 4)
        value = src.checkpoint.dir
    for name, theirs, ours in (("without", None, value), ("with", value, None)):
        setting = lambda v: [f"{key}={v}"] if v is not None else []  # noqa: E731
        c, ctx = store.prepare(f"run.name={name}", *setting(theirs))
        store.commit(c, ctx, 4)
        with pytest.raises(job.IdentityChanged) as e:
            store.prepare(f"run.name={name}", *setting(ours))
        assert f"{key} (the run: {json.dumps(theirs)}, this launch: {json.dumps(ours)})" in str(e.value)


def test_a_changed_identity_is_refused_before_the_demo_data_and_the_run_lock(store, caplog):
    """The refusal needs only the commit records: the demo data missing under paths.root is not
    generated for a launch that is refused, and the run lock is not taken."""
    import shutil

    c, ctx = store.prepare()
    store.commit(c, ctx, 4)
    lock = os.path.join(c.checkpoint.dir, "LOCK.json")
    shutil.rmtree(c.data.root)  # the demo data gone (cleaned up, or another node's paths.root)
    assert not os.path.exists(lock)  # released, as a finished job leaves it
    with pytest.raises(job.IdentityChanged, match=r"model\.width \(the run: 32, this launch: 16\)"):
        store.prepare(f"run.name={c.run.name}", "model.width=16")
    assert not os.path.exists(c.data.root) and not os.path.exists(lock)
    # forced: the same launch goes on (the data generated again), the warning said once
    with caplog.at_level(logging.WARNING):
        store.prepare(f"run.name={c.run.name}", "model.width=16", "run.allow_config_change=true")
    assert os.path.isdir(os.path.join(c.data.root, "train")) and caplog.text.count("continuing run") == 1


def test_raising_max_steps_continues_the_finished_run_and_says_what_the_lr_does(store, caplog):
    warm = "optim.schedule.warmup_steps=2"
    c, ctx = store.prepare(warm)
    store.commit(c, ctx, 12)  # finished: 12 of 12
    with pytest.raises(job.AlreadyDone, match="is complete: it reached step 12"):
        store.prepare(warm)
    with caplog.at_level(logging.WARNING):
        c2, ctx2 = store.prepare(warm, "trainer.max_steps=24")
    assert c2.run.name == c.run.name and ctx2.mlflow_run_id == ctx.mlflow_run_id
    old = 0.1 * lr_schedule(2, 12, 0.05)(12)  # the end of the old cosine: lr x min_lr_ratio
    new, end = (0.1 * lr_schedule(2, 24, 0.05)(s) for s in (12, 24))
    assert math.isclose(old, 0.005) and new > 5 * old
    text = caplog.text
    assert "trainer.max_steps 12 -> 24: the run continues from step 12 to 24" in text
    assert "optim.schedule.total_steps 12 -> 24" in text
    assert f"the old schedule gave LR {old:.4g}, the new one gives {new:.4g}" in text
    assert f"x{new / old:.3g}: the LR jumps at the resume" in text and f"then {end:.4g} at step 24" in text
    # MLflow keeps the first value as the param; each launch's change is a new one, with a summary
    store.commit(c2, ctx2, 24)
    store.prepare(warm, "trainer.max_steps=36")
    run = store.client.get_run(ctx.mlflow_run_id)
    p, tags = run.data.params, run.data.tags
    assert (p["trainer.max_steps"], p["changed.2.trainer.max_steps"], p["changed.3.trainer.max_steps"]) == (
        "12", "24", "36",
    )  # fmt: skip
    assert p["changed.3.optim.schedule.total_steps"] == "36"
    assert tags["changed.3"] == "optim.schedule.total_steps: 24 -> 36; trainer.max_steps: 24 -> 36"
    assert tags["goodput.launch"] == "3" and run.info.status == "RUNNING"


def test_a_schedule_that_ignores_max_steps_is_said_to_go_on():
    cfg = composed("optim/schedule=step")
    note = job.longer_run(cfg, 12, 12, 24)
    assert "does not depend on trainer.max_steps" in note


# -- prepare: MLflow run states ------------------------------------------------------------------------
def test_a_relaunch_closes_the_runs_a_killed_job_left_running_and_no_other(store):
    """A job killed before it ended its MLflow run leaves it RUNNING; the relaunch holding the run
    lock sets it KILLED with a tag saying so. Another run's RUNNING run (a concurrent sweep job on
    the same store, another checkpoint dir) is not touched."""
    _, killed = store.prepare()  # never ended: what a SIGKILL leaves
    _, other = store.prepare("seed=1")  # another run, "alive" meanwhile
    _, relaunched = store.prepare()
    get = store.client.get_run
    assert get(killed.mlflow_run_id).info.status == "KILLED"
    tags = get(killed.mlflow_run_id).data.tags
    assert "left RUNNING by a job that ended without closing it" in tags["error"]
    assert tags["goodput.left_running"] == "1"
    assert (
        get(other.mlflow_run_id).info.status == "RUNNING"
        and "error" not in get(other.mlflow_run_id).data.tags
    )
    assert get(relaunched.mlflow_run_id).info.status == "RUNNING"
    # killed after its last commit, before its end was written: the relaunch closes the run, then
    # continues it to write that end (the workers run no step); once FINISHED, it is complete
    c, ended = store.prepare("seed=2")
    store.commit(c, ended, 12, end=False)
    _, again = store.prepare("seed=2")
    assert again.mlflow_run_id == ended.mlflow_run_id and get(again.mlflow_run_id).info.status == "RUNNING"
    assert get(ended.mlflow_run_id).data.tags["goodput.left_running"] == "1"
    store.client.set_terminated(again.mlflow_run_id, "FINISHED")
    with pytest.raises(job.AlreadyDone):
        store.prepare("seed=2")
    assert get(ended.mlflow_run_id).info.status == "FINISHED"


def test_a_run_whose_lock_a_live_job_holds_is_left_alone(store):
    c, ctx = store.prepare()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = {"host": socket.gethostname(), "pid": sleeper.pid, "token": "x", "started": time.time()}
        with open(os.path.join(c.checkpoint.dir, "LOCK.json"), "w") as f:
            f.write(json.dumps({**lock, "heartbeat": time.time()}))
        with pytest.raises(RunLocked):
            store.prepare()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert store.client.get_run(ctx.mlflow_run_id).info.status == "RUNNING"


def test_a_failure_after_the_run_is_opened_ends_it_failed(store, monkeypatch):
    real = MlflowClient.log_batch

    def log_batch(self, run_id, metrics=(), params=(), tags=(), **kw):
        if params:
            raise RuntimeError("the store refused the params")
        return real(self, run_id, metrics=metrics, params=params, tags=tags, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    with pytest.raises(RuntimeError, match="refused the params"):
        store.prepare()
    (run,) = store.runs()
    assert (
        run.info.status == "FAILED" and run.data.tags["error"] == "RuntimeError: the store refused the params"
    )


def test_a_job_that_fails_later_ends_its_run_failed_unless_a_worker_did(store):
    c, ctx = store.prepare()
    job.close_failed(c, ctx, ValueError("a bad\n  sample"))
    run = store.client.get_run(ctx.mlflow_run_id)
    assert (run.info.status, run.data.tags["error"]) == ("FAILED", "ValueError: a bad sample")
    job.close_failed(c, ctx, KeyboardInterrupt())  # ended already: the first verdict stays
    assert store.client.get_run(ctx.mlflow_run_id).data.tags["error"] == "ValueError: a bad sample"
    c, ctx = store.prepare("seed=3")
    job.close_failed(c, ctx, KeyboardInterrupt())
    assert store.client.get_run(ctx.mlflow_run_id).info.status == "KILLED"


def test_the_demo_run_continued_to_600_steps_names_its_lr_jump():
    """docs/config.md's numbers: the demo's warmup_cosine at step 300, ending at 300 and at 600."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["trainer.max_steps=600"])
    note = job.longer_run(cfg, 300, 300, 600)
    assert (
        "the old schedule gave LR 0.005, the new one gives 0.05507 (x11: the LR jumps at the resume)" in note
    )


def test_a_malformed_identity_or_other_read_field_makes_the_commit_unloadable_and_values_print_escaped():
    from goodput.checkpoint.layout import CommitError, parse_commit
    from goodput.storage.checksum import CHECKSUM

    rec = {"step": 4, "format": "dcp", "world_size": 1, "checksum": CHECKSUM,
           "files": {"a": {"bytes": 1, CHECKSUM: "0" * 32}}}  # fmt: skip
    parse_commit(
        json.dumps({**rec, "identity": {"digest": "ab", "keys": {"seed": 1}}}).encode(), "step-000000004"
    )
    for bad in ("x", {"digest": 1, "keys": {}}, {"digest": "ab", "keys": ["seed"]}):
        with pytest.raises(CommitError, match="bad identity record"):
            parse_commit(json.dumps({**rec, "identity": bad}).encode(), "step-000000004")
    # the fields read by inspect_checkpoint.py, evaluate.py, predict.py and the relaunch
    bad_fields = [("eval_on", ["x"]), ("eval_on", "weights"), ("bytes", "big"), ("bytes", -1),
                  ("bytes", True), ("backend", {"a": 1}), ("run", 7), ("mlflow_run_id", ["r"])]  # fmt: skip
    for key, bad in bad_fields:
        with pytest.raises(CommitError, match=f"bad {key} "):
            parse_commit(json.dumps({**rec, key: bad}).encode(), "step-000000004")
    good = {"eval_on": "ema", "bytes": 1, "backend": "dcp_sync", "run": "demo", "mlflow_run_id": "ab12"}
    assert parse_commit(json.dumps({**rec, **good}).encode(), "step-000000004")["eval_on"] == "ema"
    said = identity.describe([("model.name", "\x1b[2J\nrm -rf", "resnet")])
    assert "\x1b" not in said and "\n" not in said and '"\\u001b[2J\\nrm -rf"' in said


def test_closing_leftovers_never_opens_a_half_made_store(tmp_path):
    """The relaunch looks for leftovers before it opens its run: a store half made by a job killed
    while creating it is moved aside first (tracking.ensure_store), not migrated in place."""
    import sqlite3

    from goodput.tracking import close_leftovers

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:  # what a kill during MLflow's table creation leaves
        con.execute(
            "CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name TEXT, creation_time BIGINT)"
        )
    assert close_leftovers(f"sqlite:///{db}", "goodput", str(tmp_path / "checkpoints" / "r")) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("mlflow.db.broken-")]


def test_a_complete_run_whose_store_does_not_answer_counts_as_ended(tmp_path, caplog):
    """The relaunch writes the run's end only when the store says it was not written: a store it
    cannot read (here a path it cannot create) leaves the run complete ("nothing to do")."""
    from types import SimpleNamespace

    c = SimpleNamespace(mlflow=SimpleNamespace(tracking_uri="sqlite:////proc/no/mlflow.db"),
                        run=SimpleNamespace(name="smoke-1a2b3c4d"))  # fmt: skip
    newest = {"step": 12, "mlflow_run_id": "a" * 32, "run": "smoke-1a2b3c4d"}
    with caplog.at_level(logging.WARNING):
        assert job._end_not_written(c, newest) is False
    assert f"could not read the status of MLflow run {'a' * 32}" in caplog.text
    good = f"sqlite:///{tmp_path}/mlflow.db"
    from goodput.tracking import start_run

    run_id = start_run(good, "exp", "smoke-1a2b3c4d", {}, None, str(tmp_path / "art"))
    c.mlflow.tracking_uri = good
    assert job._end_not_written(c, {**newest, "mlflow_run_id": run_id}) is True  # RUNNING: not ended
    assert job._end_not_written(c, {**newest, "mlflow_run_id": run_id, "run": "other-1a2b3c4d"}) is False
