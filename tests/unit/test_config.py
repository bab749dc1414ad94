"""Config composition: every option of every group composes and resolves; presets; the SLURM launcher."""

from __future__ import annotations

import ast
import inspect
import os
import re
import shutil

import pytest
from helpers import REPO, compose_train
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class
from omegaconf import OmegaConf

from goodput.config import SCHEMAS, ConfigError, validate

CONF = str(REPO / "conf")
GROUPS = {
    g: sorted(f[:-5] for f in os.listdir(os.path.join(CONF, g)) if f.endswith(".yaml"))
    for g in (
        "model",
        "optim",
        "data",
        "augment",
        "checkpoint",
        "parallel",
        "fault",
        "experiment",
        "paths",
        "run",
        "trainer",
        "demo_data",
        "storage",
        "mlflow",
    )
}


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_resolves(group, option):
    from goodput.run.job import epochs_to_steps

    cfg = compose_train([f"{group}={option}", "paths.root=/tmp/goodput-compose"])
    epochs_to_steps(cfg)  # as goodput.run.job.prepare does (experiment=recipe counts epochs)
    c = OmegaConf.to_container(cfg, resolve=True)
    assert c["paths"]["root"] == "/tmp/goodput-compose"
    assert c["checkpoint"]["dir"].startswith("/tmp/goodput-compose/checkpoints/")
    if group not in ("parallel",):  # ddp/fsdp want 2 processes: validated in test_train/test_parallel
        validate(c)


def test_the_default_is_the_demo_job():
    c = OmegaConf.to_container(compose_train([]), resolve=True)
    assert c["run"]["experiment"] == "demo" and c["trainer"]["max_steps"] == 300
    assert re.fullmatch(r"demo-[0-9a-f]{8}", c["run"]["name"])  # named by what it trains (test_identity)
    assert c["data"]["source"]["_target_"] == "goodput.data.sources.CachedSource"
    backend = {"_target_": "goodput.checkpoint.backends.DCPAsync", "async_type": "thread"}
    assert c["checkpoint"]["backend"] == backend
    assert c["storage"]["latency_ms"] > 0  # the demo emulates a remote volume


def test_every_state_path_derives_from_paths_root():
    c = OmegaConf.to_container(compose_train(["paths.root=/x"]), resolve=True)
    for path in (
        c["data"]["root"],
        c["data"]["cache_dir"],
        c["checkpoint"]["dir"],
        c["checkpoint"]["staging_dir"],
    ):
        assert path.startswith("/x/")
    assert c["mlflow"]["tracking_uri"] in ("sqlite:////x/mlflow.db", os.environ.get("MLFLOW_TRACKING_URI"))


def test_slurm_launcher_preset_composes():
    cfg = compose_train(["hydra/launcher=slurm", "parallel=ddp", "parallel.nproc_per_node=8"], hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 8 and launcher.signal_delay_s == 120


def test_optim_schedule_group_options_compose():
    for option in sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "optim", "schedule"))):
        c = OmegaConf.to_container(compose_train([f"optim/schedule={option}"]), resolve=True)
        assert c["optim"]["schedule"]["_target_"]


def test_a_typo_in_a_group_file_names_the_key_and_the_file(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    f = conf / "checkpoint" / "dcp_async.yaml"
    f.write_text(f.read_text() + "every_n_step: 10\n")
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(ConfigCompositionException) as e,
    ):
        compose("train")
    assert "'checkpoint/dcp_async'" in str(e.value) and "every_n_step" in str(e.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("checkpoint.every_n_step=3", "every_n_step"),
        ("data.prefetch_thread=4", "prefetch_thread"),
        ("augment.trian=[]", "trian"),
        ("trainer.max_step=5", "max_step"),
    ],
)
def test_an_unknown_override_names_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        compose_train([override])
    assert key in str(e.value) + str(e.value.__cause__)


def test_a_mistyped_value_is_refused_at_compose():
    with pytest.raises(ConfigCompositionException) as e:
        compose_train(["checkpoint.every_n_steps=often"])
    assert "checkpoint.every_n_steps" in str(e.value) + str(e.value.__cause__)


def test_one_default_per_setting():
    c = OmegaConf.to_container(compose_train(["data.image_size=64", "paths.root=/x"]), resolve=True)
    assert c["demo_data"]["image_size"] == 64 and c["data"]["root"].endswith("-s64-g0")  # one image size


# (group, the class node's key, the arguments the code passes itself)
CLASS_NODES = {"data": ("source", ("storage", "cache_dir")), "checkpoint": ("backend", ())}


@pytest.mark.parametrize("group, option", [(g, o) for g in CLASS_NODES for o in GROUPS[g]])
def test_a_class_node_lists_its_class_options_with_their_defaults(group, option):
    """`data.source` and `checkpoint.backend` show every option of their class (so `--cfg job` is the
    reference and `data.source.<option>=` needs no `+`), each at the class's own default: one
    default per setting."""
    key, passed = CLASS_NODES[group]
    node = OmegaConf.to_container(compose_train([f"{group}={option}"]), resolve=True)[group][key]
    cls = get_class(node.pop("_target_"))
    params = inspect.signature(cls).parameters
    assert node == {k: p.default for k, p in params.items() if k not in passed}
    for k in node:  # each documented where it is defined, with its trade-off
        assert f"`{k}`" in cls.__init__.__doc__, f"{cls.__name__}.__init__ does not document {k}"


def test_every_schema_field_is_documented():
    """Each field of each group's schema carries a docstring where it is defined."""
    for group, schema in SCHEMAS.items():
        tree = ast.parse(inspect.getsource(schema))
        body = tree.body[0].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and not node.target.id.startswith("_"):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                assert documented, f"{group}.{node.target.id} ({schema.__module__}) has no docstring"


def test_every_option_file_says_in_its_first_line_what_it_is():
    """`--help` shows each option with the first line of its header comment (goodput.options)."""
    from goodput import options

    groups = options.groups(str(REPO / "conf"))
    assert groups["checkpoint"].keys() == {"dcp_async", "dcp_sync", "torch_save"}  # files, not `base`
    missing = [f"conf/{g}/{o}.yaml" for g, opts in groups.items() for o, text in opts.items() if not text]
    assert not missing, f"start these with a `# what this option is` line: {missing}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_steps=-1", "trainer.max_steps must be > 0"),
        ("trainer.global_batch_size=0", "trainer.global_batch_size must be > 0"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1"),
        ("checkpoint.every_n_steps=0", "checkpoint.every_n_steps must be > 0"),
        ("data.root=nosuchproto://x/y", "unknown storage protocol 'nosuchproto://'"),
        ("parallel=fsdp parallel.nproc_per_node=1", "shards parameters: it needs more than one process"),
        ("parallel=ddp trainer.global_batch_size=15", "not divisible by the world size 2"),
        ("parallel=ddp parallel.nproc_per_node=64", "more processes than this machine can run"),
    ],
)  # fmt: skip
def test_a_bad_command_line_fails_at_validate_naming_the_key(override, message):
    """The command-line overrides as the entry point gets them, composed and validated: the check
    that runs before any work (e2e/test_train.py runs three such refusals through the entry point)."""
    c = OmegaConf.to_container(
        compose_train(["paths.root=/x", "experiment=smoke", *override.split()]), resolve=True
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(c)


def test_checks_live_in_the_schema():
    V2 = "torchvision.transforms.v2."
    c = OmegaConf.to_container(compose_train(["paths.root=/x"]), resolve=True)
    for key, value, message in [
        ("checkpoint", {"keep_last": 0}, "checkpoint.keep_last must be >= 1"),
        ("data", {"on_bad_sample": "ignore"}, "data.on_bad_sample must be error|skip"),
        ("fault", {"chaos_p": 2.0}, "fault.chaos_p must be in [0, 1]"),
        ("trainer", {"progress": "sometimes"}, "trainer.progress must be auto|bar|lines|true|false"),
        ("augment", {"train": [{"_target_": V2 + "CenterCrop", "size": 8}]}, "3 x 32 x 32"),
    ]:
        bad = {**c, key: {**c[key], **value}}
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(bad)


def test_checks_that_need_only_the_config_fail_at_validate_naming_the_key():
    """#34: a negative learning rate and a keep_best_by metric that cannot exist failed only after
    the demo data was made (a traceback from the optimizer's constructor, or the build's check)."""
    from helpers import check_config_change

    c = OmegaConf.to_container(compose_train(["paths.root=/x", "experiment=smoke"]), resolve=True)
    sgd, adamw = c["optim"]["optimizer"], {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3}
    three = {"demo_data": {"num_classes": 3}}  # the demo data: its class count is in the config
    for change, message in [
        ({"optim": {"optimizer": {**sgd, "lr": -0.1}}},
         "optim.optimizer.lr=-0.1: Invalid learning rate: -0.1"),
        ({"optim": {"optimizer": {**adamw, "betas": [0.9, 1.5]}}},
         "optim.optimizer.betas=[0.9, 1.5]: Invalid beta"),
        ({"optim": {"optimizer": {**sgd, "momentum": -1.0}}}, "optim.optimizer.momentum=-1.0"),
        ({"checkpoint": {"keep_best_by": "val/top5"}, **three},
         "checkpoint.keep_best_by=val/top5 is not a metric every evaluation logs: task Classification logs "
         "val/loss, val/accuracy with 3 classes"),
        ({"trainer": {"early_stopping_patience": 2, "early_stopping_by": "val/top5", "eval_every_n_steps": 4},
          **three}, "trainer.early_stopping_by=val/top5 is not a metric every evaluation logs"),
        ({"checkpoint": {"keep_best_by": "val/top5"}}, None),  # 10 classes
        ({"checkpoint": {"keep_best_by": "val/top5"}, **three, "data": {"root": "/my/data"}},
         None),  # not the demo data: its classes are counted once it is listed
        ({"optim": {"optimizer": {**sgd, "lr": 0.0}}}, None),
        ({"optim": {"schedule": {**c["optim"]["schedule"], "warmup_steps": -5}}},
         "optim.schedule.warmup_steps=-5: warmup_steps must be an integer >= 0, got -5"),
        ({"optim": {"schedule": {**c["optim"]["schedule"], "min_lr_ratio": 1.5}}},
         "optim.schedule.min_lr_ratio=1.5: min_lr_ratio must be a number in [0, 1], got 1.5"),
        ({"optim": {"schedule": {**c["optim"]["schedule"], "warmup_steps": 0}}}, None),
    ]:  # fmt: skip
        check_config_change(c, change, message)
    for seed in ("abc", 1.5, True, 2**64):
        with pytest.raises(ConfigError, match=re.escape(f"seed must be an integer, got {seed!r}")):
            validate({**c, "seed": seed})
    for seed in (0, -1, 2**63):
        validate({**c, "seed": seed})


def test_settings_that_do_nothing_warn_at_validate(caplog):
    c = OmegaConf.to_container(compose_train(["paths.root=/x", "experiment=smoke"]), resolve=True)  # 12 steps
    tr = c["trainer"]
    for change, warning in [
        ({"early_stopping_patience": 1, "eval_every_n_steps": 20},
         "trainer.early_stopping_patience=1 can never stop the run: trainer.eval_every_n_steps=20 with "
         "trainer.max_steps=12 makes 1 evaluation(s)"),
        ({"early_stopping_patience": 3, "eval_every_n_steps": 4}, "makes 3 evaluation(s)"),  # 4, 8, 12
        ({"profile_start_step": 13}, "trainer.profile_start_step=13 is after trainer.max_steps=12"),
        ({"early_stopping_patience": 2, "eval_every_n_steps": 4}, None),  # can stop at step 12
        ({"profile_start_step": 12}, None),
    ]:  # fmt: skip
        caplog.clear()
        with caplog.at_level("WARNING", logger="goodput.config"):
            validate({**c, "trainer": {**tr, **change}})
        if warning is None:
            assert not caplog.records, caplog.text
        else:
            assert warning in caplog.text


def test_eval_top_k_at_the_class_count_warns_once_the_data_is_listed(tmp_path, monkeypatch, caplog):
    import time

    from goodput.data.synthetic import make_dataset
    from goodput.parallel import LAUNCHER_ENV, init_distributed, shutdown_distributed
    from goodput.run import build
    from goodput.run.context import RunContext

    root = tmp_path / "d"
    make_dataset(str(root), num_classes=3, train_per_class=8, val_per_class=1, image_size=16)
    c = OmegaConf.to_container(
        compose_train(
            [f"paths.root={tmp_path}", "experiment=smoke", f"data.root={root}", "trainer.eval_top_k=3"]
        ),
        resolve=True,
    )
    typed = validate(c)  # the classes are not known from the config here
    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    with caplog.at_level("WARNING", logger="goodput"):
        t = build.Trainer(typed, RunContext(str(tmp_path / "run"), time.time(), "0" * 16), init_distributed())
    t.close()
    shutdown_distributed()
    assert (
        "trainer.eval_top_k=3 with 3 classes: val/top3 counts every sample, it is always 1.0" in caplog.text
    )


def test_schedules_from_target_nodes():
    import torch
    from hydra.utils import instantiate

    from goodput.run.schedule import lr_schedule

    params = [torch.nn.Parameter(torch.zeros(1))]
    cfg = compose_train(["optim/schedule=step", "optim.schedule.step_size=2"])
    c = OmegaConf.to_container(cfg, resolve=True)
    sched = instantiate(c["optim"]["schedule"])(torch.optim.SGD(params, lr=1.0))
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(4):
        sched.step()
    assert sched.get_last_lr() == [0.25]
    c = OmegaConf.to_container(compose_train(["trainer.max_steps=50"]), resolve=True)
    sched = instantiate(c["optim"]["schedule"])(torch.optim.SGD(params, lr=1.0))  # the default
    f = lr_schedule(20, 50, 0.05)
    for step in range(50):
        assert sched.get_last_lr() == [f(step)]
        sched.step()


def test_a_data_option_file_is_a_short_diff(tmp_path):
    """docs/config.md's conf/data/flowers.yaml: the schema fills every other key."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "data" / "flowers.yaml").write_text(
        "defaults: [cached]\nroot: s3://my-bucket/flowers\nimage_size: 128\n"
    )
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        c = OmegaConf.to_container(compose("train", overrides=["data=flowers"]), resolve=True)
    assert c["data"]["root"] == "s3://my-bucket/flowers" and c["data"]["source"]["prefetch_threads"] == 16
    assert c["augment"]["train"][0]["size"] == 128
    validate(c)


@pytest.mark.parametrize(
    "group",
    [
        "checkpoint",
        "data",
        "augment",
        "parallel",
        "fault",
        "optim",
        "paths",
        "run",
        "trainer",
        "demo_data",
        "storage",
        "mlflow",
    ],  # fmt: skip
)
def test_option_files_start_from_their_schema(group):
    """An option file is a diff over `<group>/base`, so its keys are checked and its defaults shared."""
    for name in GROUPS[group]:
        cfg = OmegaConf.load(os.path.join(CONF, group, f"{name}.yaml"))
        assert list(cfg.get("defaults", [])) == ["base"], f"conf/{group}/{name}.yaml: add `defaults: [base]`"


def test_run_state_travels_beside_the_config_not_in_it(tmp_path, monkeypatch):
    """`prepare` returns the typed config (schema instances, read as attributes) and, beside it, the
    launch's RunContext. Two launches of one config from different run dirs (and times) are one
    identity: the same config hash, and the MLflow params name no run dir, start, hash or run id."""
    from mlflow import MlflowClient

    from goodput.config import Config
    from goodput.parallel import LAUNCHER_ENV
    from goodput.run.config import TrainerConfig
    from goodput.run.context import RunContext
    from goodput.run.job import prepare

    for k in LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    cfg = compose_train(["experiment=smoke", f"paths.root={tmp_path}"])
    contexts = []
    for run_dir in ("run-a", "run-b"):
        c, ctx, lock = prepare(cfg, str(tmp_path / run_dir))
        lock.release()
        contexts.append(ctx)
        assert isinstance(c, Config) and isinstance(c.trainer, TrainerConfig) and c.trainer.max_steps == 12
        assert isinstance(ctx, RunContext) and ctx.run_dir == str(tmp_path / run_dir) and ctx.mlflow_run_id
        params = MlflowClient(c.mlflow.tracking_uri).get_run(ctx.mlflow_run_id).data.params
        assert params["trainer.max_steps"] == "12"
        # (paths.run_dir is a key: the root of all run dirs. These are what a launch wrote in before.)
        assert not {"run_dir", "job_start", "config_hash", "mlflow_run_id"} & set(params)
    a, b = contexts
    assert a.config_hash == b.config_hash and a.job_start != b.job_start
