"""The config on the entry point: a custom model and LR scheduler by `_target_` in a real run; the
compose API in a fresh interpreter; `--help`."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO, TRAIN, run_train


def test_own_model_and_scheduler_on_the_entry_point(tmp_path, smoke_reference):
    """docs/config.md's examples: any model and any LR scheduler are a `_target_` node."""
    _, s = run_train(tmp_path, "model=resnet18", "optim/schedule=step", "optim.schedule.step_size=4")
    assert s["steps"] == 12 and s["last_committed_step"] == 12
    assert s["model_sha256"] != smoke_reference("dcp_sync")["model_sha256"]


# A notebook: nothing of goodput imported, Hydra's compose API on conf/. The schemas must come from
# Hydra's plugin discovery (hydra_plugins.goodput_config), and cheaply: no torch, no mlflow.
FRESH = """
import sys
from hydra import compose, initialize_config_dir
assert not [m for m in sys.modules if m.split(".")[0] in ("goodput", "hydra_plugins")], "imported already"
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose("train", overrides=["fault.kill_at_step=3", "checkpoint=torch_save"])
print(cfg.fault.kill_at_step, cfg.checkpoint.every_n_steps, cfg.checkpoint.backend._target_)
print(sorted(m for m in ("torch", "mlflow", "torchvision", "optuna") if m in sys.modules))
"""


def test_the_config_composes_in_an_interpreter_that_imported_nothing_of_goodput(tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", FRESH, str(REPO / "conf")], cwd=tmp_path, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-3000:]
    values, heavy = p.stdout.splitlines()
    assert values.split() == ["3", "50", "goodput.checkpoint.backends.TorchSave"]  # the schema + the files
    assert heavy == "[]", f"composing the config imported {heavy}: every compose and --help pay for it"


def test_help_lists_each_group_s_options_with_their_descriptions(tmp_path):
    """`--help` lists the option files of each group (not `base`, the schema in Hydra's store), each
    with the first line of its header comment, and not the whole composed config."""
    p = subprocess.run([sys.executable, TRAIN, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert "checkpoint: dcp_async, dcp_sync, torch_save  (selected: dcp_async)" in lines
    assert "optim/schedule: cosine, step, warmup_cosine  (selected: warmup_cosine)" in lines
    found = (re.match(r"^([a-z_/]+): ([^ ]+(?:, [^ ]+)*)", ln) for ln in lines)
    groups = {m[1]: m[2].split(", ") for m in found if m}
    assert len(groups) >= 15 and not [g for g, opts in groups.items() if "base" in opts]
    from goodput import options

    torch_save = next(ln for ln in lines if ln.strip().startswith("torch_save "))
    assert torch_save.split(None, 1)[1] == options.description(str(REPO / "conf/checkpoint/torch_save.yaml"))
    assert "global_batch_size" not in p.stdout  # the config is `--cfg job`'s
