"""Config composition: every option of every group composes and resolves; presets; the SLURM launcher."""

from __future__ import annotations

import os

import pytest
from conftest import REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from goodput.config import validate

CONF = str(REPO / "conf")
GROUPS = {
    g: sorted(f[:-5] for f in os.listdir(os.path.join(CONF, g)) if f.endswith(".yaml"))
    for g in ("model", "optim", "data", "checkpoint", "parallel", "fault", "experiment", "paths")
}


def _compose(overrides, hydra=False):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra)


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_resolves(group, option):
    cfg = _compose([f"{group}={option}", "paths.root=/tmp/goodput-compose"])
    c = OmegaConf.to_container(cfg, resolve=True)
    assert c["paths"]["root"] == "/tmp/goodput-compose"
    assert c["checkpoint"]["dir"].startswith("/tmp/goodput-compose/checkpoints/")
    if group not in ("parallel",):  # ddp/fsdp want 2 processes: validated in test_train/test_parallel
        validate(c)


def test_the_default_is_the_demo_job():
    c = OmegaConf.to_container(_compose([]), resolve=True)
    assert c["run"]["name"] == "demo" and c["trainer"]["max_steps"] == 300
    assert c["data"]["backend"] == "cached" and c["checkpoint"]["backend"] == "dcp_async"
    assert c["storage"]["latency_ms"] > 0  # the demo emulates a remote volume


def test_every_state_path_derives_from_paths_root():
    c = OmegaConf.to_container(_compose(["paths.root=/x"]), resolve=True)
    for path in (
        c["data"]["root"],
        c["data"]["cache_dir"],
        c["checkpoint"]["dir"],
        c["checkpoint"]["staging_dir"],
    ):
        assert path.startswith("/x/")
    assert c["mlflow"]["tracking_uri"] in ("sqlite:////x/mlflow.db", os.environ.get("MLFLOW_TRACKING_URI"))


def test_slurm_launcher_preset_composes():
    cfg = _compose(["hydra/launcher=slurm", "parallel=ddp", "parallel.nproc_per_node=8"], hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 8 and launcher.signal_delay_s == 120
