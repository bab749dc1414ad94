"""The augment group: presets and custom lists by _target_, per-sample seeding with every option."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torchvision.transforms import v2

from goodput.data import augment
from goodput.data.loader import DataConfig, ResumableLoader
from goodput.data.synthetic import make_dataset
from goodput.storage.remote import Storage

PRESETS = ("none", "light", "standard", "ta_wide", "randaugment")
STEPS = 10


def augment_node(option: str, conf=REPO / "conf") -> dict:
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=[f"augment={option}", "data.image_size=16", "paths.root=/tmp/x"])
    return OmegaConf.to_container(cfg, resolve=True)["augment"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_dataset(str(root), num_classes=4, train_per_class=10, val_per_class=2, image_size=24)
    return str(root)


def loader(root, cache_dir, node, workers=0, repeats=1):
    cfg = DataConfig(
        source={"_target_": "goodput.data.sources.CachedSource", "prefetch_threads": 4}, root=root,
        cache_dir=str(cache_dir), image_size=16, num_workers=workers, prefetch_factor=2, prefetch_steps=3,
        repeated_augment=repeats,
    )  # fmt: skip
    return ResumableLoader(cfg, Storage(root), 5, 8, STEPS, 0, 1, torch.device("cpu"), augment=node)


def batches(ld, n):
    return [next(ld)["image"] for _ in range(n)]


def test_standard_is_the_pipeline_it_replaced():
    """The default must keep existing runs' tensors (and model hashes) bit for bit."""
    old = v2.Compose(
        [
            v2.RandomResizedCrop(16, scale=(0.6, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        ]
    )
    new, _ = augment.build(augment_node("standard"), 16)
    assert augment.build(None, 16)[0].__repr__() == new.__repr__()  # the schema default is `standard`
    img = torch.randint(0, 256, (3, 23, 31), dtype=torch.uint8)
    for seed in range(20):
        torch.manual_seed(seed)
        a = old(img)
        torch.manual_seed(seed)
        assert torch.equal(a, new(img))


@pytest.mark.parametrize("preset", PRESETS)
def test_batches_are_identical_for_any_worker_count_and_resume(data_root, tmp_path, preset):
    node = augment_node(preset)
    train_tf, eval_tf = augment.build(node, 16)
    ref_loader = loader(data_root, tmp_path / "c", node, workers=0)
    ref = batches(ref_loader, STEPS)  # 10 steps of 8 over 40 samples: two epochs
    ref_loader.close()
    a = loader(data_root, tmp_path / "c", node, workers=1)
    first = batches(a, 3)
    sd = a.state_dict()
    a.close()
    b = loader(data_root, tmp_path / "c", node, workers=2)
    b.load_state_dict(sd)
    rest = batches(b, STEPS - 3)
    b.close()
    for x, y in zip(first + rest, ref, strict=True):
        assert x.shape == (8, 3, 16, 16) and torch.equal(x, y)
    if preset == "none":  # no randomness: training sees the eval view
        img = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8)
        assert torch.equal(train_tf(img), eval_tf(img))
    else:  # a sample seen in two epochs is augmented differently
        order = ref_loader.order
        idx0 = order.global_batch(0).tolist()
        later = {i: (s, k) for s in range(5, STEPS) for k, i in enumerate(order.global_batch(s).tolist())}
        k0, i = next((k, i) for k, i in enumerate(idx0) if i in later)
        s1, k1 = later[i]
        assert not torch.equal(ref[0][k0], ref[s1][k1])


def test_a_custom_list_by_target(tmp_path, data_root):
    """A user's own preset is one YAML file in conf/augment; any v2 transform works."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "augment" / "digits.yaml").write_text(
        "defaults: [base]\n"
        "train:\n"
        "  - _target_: torchvision.transforms.v2.RandomRotation\n"
        "    degrees: 10\n"
        "  - _target_: torchvision.transforms.v2.Resize\n"
        "    size: ${data.image_size}\n"
        "  - _target_: torchvision.transforms.v2.RandomCrop\n"
        "    size: ${data.image_size}\n"
        "    padding: 2\n"
        "mean: [0.5, 0.5, 0.5]\n"
        "std: [0.5, 0.5, 0.5]\n"
    )
    node = augment_node("digits", conf)
    train_tf, eval_tf = augment.build(node, 16)
    assert [type(t).__name__ for t in train_tf.transforms] == [
        "RandomRotation", "Resize", "RandomCrop", "ToDtype", "Normalize",
    ]  # fmt: skip
    assert eval_tf.transforms[-1].std == [0.5, 0.5, 0.5]  # eval normalizes like training
    a = batches(loader(data_root, tmp_path / "c", node, workers=2), 3)
    b = batches(loader(data_root, tmp_path / "c", node, workers=0), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_list_that_does_not_end_at_image_size_fails_at_build():
    node = {"train": [{"_target_": "torchvision.transforms.v2.RandomCrop", "size": 8}]}
    with pytest.raises(ValueError, match=r"must produce a 3 x 16 x 16 image .* got \(3, 8, 8\)"):
        augment.build(node, 16)
    with pytest.raises(ValueError, match=r"augment.train\[0\] must be a node with a _target_"):
        augment.build({"train": ["flip"]}, 16)


def test_random_erasing_after_normalization_erases_to_the_mean():
    """augment.after_normalize runs on the normalized tensor: ta_wide's RandomErasing leaves a box
    of exact zeros (the mean), as torchvision's reference does; erasing before Normalize would
    leave -mean/std there instead."""
    node = augment_node("ta_wide")
    node["after_normalize"][0]["p"] = 1.0
    train, _ = augment.build(node, 16)
    assert [type(t).__name__ for t in train.transforms][-3:] == ["ToDtype", "Normalize", "RandomErasing"]
    img = torch.full((3, 24, 24), 200, dtype=torch.uint8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x = train(img)
    erased = (x == 0).all(0)
    assert erased.any() and not erased.all()
    assert torch.allclose(x[:, ~erased].mean(), torch.tensor((200 / 255 - 0.5) / 0.25), atol=0.6)


def test_repeated_augmentation_copies_differ_and_resume_at_any_worker_count(data_root, tmp_path):
    """data.repeated_augment=2: every step holds each of its samples twice, each copy augmented on
    its own seed; the batches are the same with 0 or 2 workers and across a resume."""
    node = augment_node("standard")
    ref_loader = loader(data_root, tmp_path / "c", node, repeats=2)
    ref, indices = [], []
    for _ in range(STEPS):
        b = next(ref_loader)
        ref.append(b["image"])
        indices.append(b["index"].tolist())
    ref_loader.close()
    assert all(ix[:4] == ix[4:] for ix in indices)  # 4 samples a step, twice
    assert not torch.equal(ref[0][0], ref[0][4])  # the two copies of sample ix[0] differ
    assert ref_loader.order.steps_per_epoch == 40 * 2 // 8
    a = loader(data_root, tmp_path / "c", node, workers=2, repeats=2)
    first = batches(a, 4)
    sd = a.state_dict()
    a.close()
    b = loader(data_root, tmp_path / "c", node, workers=1, repeats=2)
    b.load_state_dict(sd)
    rest = batches(b, STEPS - 4)
    b.close()
    assert all(torch.equal(x, y) for x, y in zip(first + rest, ref, strict=True))
