"""The recipe under kill + resume, through scripts/check.py (what `make check` runs): the V2 recipe's
parts (label smoothing, MixUp/CutMix, TrivialAugmentWide with random erasing, no weight decay on
norm layers, repeated augmentation) with a transform drawing from Python's and NumPy's generators
resume bit for bit at 1 and 2 ranks (BatchNorm and dropout on 2), task=multilabel too; and a
researcher's edit, in a copy of the repository: the same command is refused naming the changed
file, and `make check` names the model when the edit keeps state outside the checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import PY_RANDOM_AUGMENT, REPO, entry_env

pytestmark = pytest.mark.slow

# the V2 recipe's parts together (issue: each resumes bit for bit), and a transform of a researcher's
# own drawing from Python's and NumPy's generators (after normalization, beside random erasing)
RECIPE = [
    "task.loss.label_smoothing=0.1", "batch_augment=mixup_cutmix", "augment=ta_wide",
    "optim.norm_weight_decay=0.0", "data.repeated_augment=2",
    "augment.after_normalize=[{_target_:torchvision.transforms.v2.RandomErasing,p:0.5},{_target_:helpers.PyRandomShift}]",
]  # fmt: skip
# BatchNorm buffers and dropout on 2 ranks (trainer.sync_batchnorm is CUDA only: scripts/gpu_check.sh)
BATCHNORM = ["model._target_=helpers.StochasticNet.build", "model.width=8"]


def check(*overrides: str, repo=REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**entry_env(), "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(REPO / "tests")])}
    cmd = [sys.executable, str(repo / "scripts" / "check.py"), "--steps", "6", "--kill-at", "3", *overrides]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(RECIPE, id="classification-1-rank"),
        pytest.param(
            [*RECIPE, *BATCHNORM, "parallel=ddp", "parallel.nproc_per_node=2"], id="classification-2-ranks"
        ),
        pytest.param(
            ["task=multilabel", "batch_augment=mixup_cutmix", "augment=none", PY_RANDOM_AUGMENT],
            id="multilabel-1-rank",
        ),  # fmt: skip
    ],
)
def test_the_recipe_resumes_bit_for_bit(overrides, tmp_path):
    p = check("experiment=smoke", f"paths.root={tmp_path}", *overrides)
    assert p.returncode == 0 and "check: resume is exact" in p.stdout, p.stdout + p.stderr[-3000:]


def test_an_edit_is_refused_and_a_counter_in_forward_is_named_by_make_check(tmp_path):
    """A researcher's session in a copy of the repository: a run; an edit of the model (a Python
    counter in forward: state the checkpoint does not hold); the same command is refused, naming
    the file; scripts/check.py then names the model as the first state that differs."""
    repo = tmp_path / "repo"
    for part in ("src", "conf", "scripts"):
        shutil.copytree(REPO / part, repo / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    train = [
        sys.executable,
        str(repo / "scripts" / "train.py"),
        "experiment=smoke",
        f"paths.root={tmp_path / 'out'}",
    ]
    env = {**entry_env(), "PYTHONPATH": str(repo / "src")}
    first = subprocess.run(train, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    models = repo / "src" / "goodput" / "recipe" / "models.py"
    text = models.read_text()
    forward = "    def forward(self, x):\n"
    assert text.count(forward) == 1
    models.write_text(text.replace(forward, forward + (
        "        self.calls = getattr(self, 'calls', 0) + 1  # not in the checkpoint\n"
        "        x = x * (1.0 + 0.01 * (self.calls % 3))\n"
    )))  # fmt: skip
    again = subprocess.run(train, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "was written by other code than this launch's: goodput/recipe/models.py changed" in again.stderr
    p = check("experiment=smoke", f"paths.root={tmp_path / 'out'}", repo=repo)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    assert "check: model: blocks.0.0.weight differs after the resume at step" in p.stdout, p.stdout
