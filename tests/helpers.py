"""Shared test helpers: run the real entry point on tiny configs in tmp dirs, read what it wrote.

Import them from here (`from helpers import run_train`); conftest.py re-exports them for the tests
that still say `from conftest import ...`, and holds the fixtures."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

from goodput.parallel import without_launcher_env

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "scripts" / "train.py")


def train_cmd(root, *overrides: str, experiment: str = "smoke") -> list[str]:
    flags = [o for o in overrides if o.startswith("-")]  # Hydra wants -m before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return [sys.executable, TRAIN, *flags, f"experiment={experiment}", f"paths.root={root}", *rest]


def entry_env() -> dict:
    """The environment for the entry point: no launcher variables, no outside MLflow store."""
    return {**without_launcher_env(None, "MLFLOW_TRACKING_URI"), "PYTHONUNBUFFERED": "1"}


def start_train(cmd: list[str], out) -> subprocess.Popen:
    """Start `cmd` (see train_cmd) in its own session, so a test can signal its whole process group."""
    return subprocess.Popen(
        cmd, cwd=REPO, env=entry_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def run_train(root, *overrides: str, expect_rc: int = 0, timeout: int = 300, experiment: str = "smoke"):
    """Run scripts/train.py; returns (completed process, newest summary.json or None)."""
    env = entry_env()
    p = subprocess.run(
        train_cmd(root, *overrides, experiment=experiment),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect_rc is not None and p.returncode != expect_rc:
        raise AssertionError(
            f"train.py exited {p.returncode} (expected {expect_rc})\n--- stdout\n{p.stdout[-4000:]}\n"
            f"--- stderr\n{p.stderr[-6000:]}"
        )
    return p, latest_summary(root)


def latest_summary(root) -> dict | None:
    files = sorted(glob.glob(f"{root}/runs/**/summary.json", recursive=True), key=os.path.getmtime)
    if not files:
        return None
    with open(files[-1]) as f:
        return json.load(f)


def final_checkpoint_state(ckpt_dir) -> tuple[str, str]:
    """(model_sha256, sample_order_sha256) of the newest committed checkpoint, read back from disk."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from goodput.checkpoint.backends import SafeFileSystemReader
    from goodput.checkpoint.layout import local_commits
    from goodput.checkpoint.state import decode
    from goodput.model import SmallCNN, model_sha256

    newest = Path(local_commits(ckpt_dir)[-1][1])
    if (newest / "state.pt").exists():
        full = torch.load(newest / "state.pt", weights_only=True)
        model_sd, data = full["model"], decode(full["extra"]["data"])
    else:
        reader = SafeFileSystemReader(str(newest))
        md = reader.read_metadata().state_dict_metadata
        sd = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in md.items()
            if (k.startswith("model.") or k == "extra.data") and isinstance(m, TensorStorageMetadata)
        }
        dcp.load(sd, storage_reader=reader, no_dist=True)
        model_sd = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")}
        data = decode(sd["extra.data"])
    model = SmallCNN(num_classes=10, width=32)
    model.load_state_dict(model_sd)
    return model_sha256(model), data["sample_order_sha256"]


def check_config_change(c: dict, change: dict, message: str | None) -> None:
    """`c` with each group of `change` updated validates (message None), or fails naming `message`."""
    import re

    import pytest

    from goodput.config import ConfigError, validate

    bad = {**c, **{k: {**c[k], **v} for k, v in change.items()}}
    if message is None:
        validate(bad)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(bad)
