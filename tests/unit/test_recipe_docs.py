"""docs/recipe.md's examples work as written: every ```python block runs (in order, in one namespace
holding the imports of the recipe files they go into), and what each defines does what the page
says. A page whose example broke fails here, not in a researcher's first hour."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import REPO
from hydra.utils import instantiate
from torch import nn

import goodput.recipe.task as task_module
from goodput.data.dataset import CsvManifest
from goodput.data.sampler import batch_seed
from goodput.recipe.metrics import ClassificationMetrics
from goodput.recipe.models import shard_plan, shard_units
from goodput.recipe.task import Classification
from goodput.storage.remote import Storage

PAGE = (REPO / "docs" / "recipe.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, re.S)


@pytest.fixture(scope="module")
def ns():
    space = {"torch": torch, "nn": nn, "F": F, "Classification": Classification, "CsvManifest": CsvManifest,
             "ClassificationMetrics": ClassificationMetrics}  # fmt: skip
    for code in blocks("python"):
        exec(compile(code, "docs/recipe.md", "exec"), space)
    return space


def test_the_focal_loss_and_its_option_file(ns, monkeypatch):
    monkeypatch.setattr(task_module, "FocalLoss", ns["FocalLoss"], raising=False)
    node = yaml.safe_load(blocks("yaml")[0])
    node["top_k"] = None  # (an interpolation outside a composed config)
    task = instantiate(node)
    logits, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    per = task.loss(logits, y)
    assert per.shape == (6,)  # the task made it per sample
    ce = F.cross_entropy(logits, y, reduction="none")
    assert torch.all(per < ce) and torch.allclose(task.loss(logits, task.soft(y, 4)), per)  # soft targets too
    assert torch.allclose(ns["FocalLoss"](gamma=0.0)(logits, y), ce.mean())


def test_the_batch_transform_is_seeded_by_the_engine(ns):
    noise, x = ns["GaussianNoise"](0.5), torch.zeros(4, 3, 2, 2)

    def at(step):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(batch_seed(0, step))
            return noise(x, torch.eye(4))[0]

    assert torch.equal(at(3), at(3)) and not torch.equal(at(3), at(4)) and at(3).std() > 0.1


def test_the_model_and_its_shard_plan(ns):
    model = ns["ResidualCNN"](num_classes=5, width=8, depth=3)
    assert len(shard_units(model, shard_plan(model, None))) == 3
    assert model(torch.zeros(2, 3, 8, 8)).shape == (2, 5)


def test_the_metric_is_computed_and_monitorable(ns):
    from goodput.checkpoint.config import CheckpointConfig
    from goodput.config import monitors_logged
    from goodput.run.config import TrainerConfig

    task = ns["BalancedClassification"](nn.CrossEntropyLoss())
    m = task.metrics(["a", "b"])
    # class a: 3 samples, 3 right; class b: 1 sample, 0 right -> accuracy 3/4, balanced (1 + 0) / 2
    m.update(torch.tensor([[1.0, 0], [1, 0], [1, 0], [1, 0]]), torch.tensor([0, 0, 0, 1]), torch.ones(4))
    m.reduce(1)
    out = m.compute()
    assert out["val/accuracy"] == 0.75 and out["val/balanced_accuracy"] == 0.5
    ck = CheckpointConfig(
        backend={"_target_": "x"}, dir="/x", staging_dir="/y", keep_best_by="val/balanced_accuracy"
    )
    tr = TrainerConfig(max_steps=4, global_batch_size=4)
    assert monitors_logged(task, tr, ck, 2) == []
    assert monitors_logged(Classification(nn.CrossEntropyLoss()), tr, ck, 2) != []


def test_the_dataset_class(ns, tmp_path):
    (tmp_path / "imgs").mkdir()
    for n in ("a.jpg", "b.jpg"):
        (tmp_path / "imgs" / n).write_bytes(b"x")
    (tmp_path / "train_labels.csv").write_text("path,label\nimgs/a.jpg,cat\nimgs/b.jpg,dog\n")
    ds = ns["LabelsFile"](Storage(str(tmp_path)), "train")
    assert ds.files == ["imgs/a.jpg", "imgs/b.jpg"] and ds.classes == ["cat", "dog"] and ds.target(1) == 1


def test_the_parameter_groups(ns):
    import torchvision

    model = torchvision.models.mobilenet_v3_small(num_classes=3)
    rest, slow = ns["backbone_groups"](model, lr=0.2)
    assert slow["lr"] == pytest.approx(0.02) and len(slow["params"]) + len(rest["params"]) == len(
        list(model.parameters())
    )
    torch.optim.SGD([rest, slow], lr=0.2)  # a valid set of groups
