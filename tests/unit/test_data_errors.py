"""Data refusals in one line naming the thing (too small, class mismatch, a file that does not
decode, also when a DataLoader worker raised it), every image format Pillow reads, and the warning
when the dropped last batch of each epoch is more than a tenth of it. In-process; the entry point's
view: e2e/test_messages_runs.py."""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from goodput.data.config import DataConfig
from goodput.data.dataset import (
    IMAGE_EXTENSIONS,
    BadSampleError,
    DataRootError,
    ImageDataset,
    ImageFolder,
    check_same_classes,
    decode,
)
from goodput.data.loader import ResumableLoader
from goodput.data.sampler import DatasetTooSmall, dropped_per_epoch
from goodput.data.sources import RemoteSource
from goodput.data.synthetic import make_dataset
from goodput.errors import UserError
from goodput.storage.remote import Storage

WANTED = (".webp", ".bmp", ".gif", ".tif", ".tiff")  # were skipped as non-images (issue 29)
TESTED = sorted(set(IMAGE_EXTENSIONS) | set(WANTED))
FORMAT = {ext: Image.registered_extensions()[ext] for ext in TESTED}
LOSSY = {".jpg", ".jpeg", ".webp", ".avif"}


def pixels(seed: int = 0, mode: str = "RGB") -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def encoded(im: Image.Image, ext: str) -> bytes:
    b = io.BytesIO()
    im.save(b, format=FORMAT[ext])
    return b.getvalue()


def as_pillow_reads_it(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)


def loader(root, cache_dir, global_batch=8, workers=0, rank=0, world=1) -> ResumableLoader:
    cfg = DataConfig(
        source={"_target_": "goodput.data.sources.RemoteSource"}, root=str(root), cache_dir=str(cache_dir),
        image_size=16, num_workers=workers, prefetch_factor=2, prefetch_steps=2,
    )  # fmt: skip
    return ResumableLoader(cfg, Storage(str(root)), 5, global_batch, 4, rank, world, torch.device("cpu"))


@pytest.fixture(scope="module")
def thirty(tmp_path_factory):
    """3 classes x 10 train images."""
    root = tmp_path_factory.mktemp("thirty")
    make_dataset(str(root), num_classes=3, train_per_class=10, val_per_class=2, image_size=16)
    return root


# -- every format Pillow reads ------------------------------------------------------------------
@pytest.mark.parametrize("ext", TESTED)
def test_every_listed_extension_is_listed_and_decodes(tmp_path, ext):
    """.webp, .bmp, .gif, .tif, ... were skipped as non-images; each is listed and decodes, to the
    RGB tensor Pillow reads from the same bytes (the fast path, JPEG and PNG, to the same shape)."""
    for cls in ("a", "b"):
        (tmp_path / "train" / cls).mkdir(parents=True)
        (tmp_path / "train" / cls / f"x{ext.upper() if cls == 'b' else ext}").write_bytes(
            encoded(pixels(), ext)
        )
    files = ImageFolder(Storage(str(tmp_path)), "train")
    assert len(files) == 2 and files.classes == ["a", "b"]
    data = (tmp_path / files.files[0]).read_bytes()
    img = decode(data)
    assert img.dtype == torch.uint8 and img.shape == (3, 9, 7)
    assert torch.equal(decode(data), img)  # deterministic
    if data.startswith((b"\xff\xd8", b"\x89PNG")):  # torchvision's decoders
        if ext not in LOSSY:
            assert torch.equal(img, as_pillow_reads_it(data))
    else:
        assert torch.equal(img, as_pillow_reads_it(data))
    if ext not in LOSSY:
        assert torch.equal(img, torch.from_numpy(np.array(pixels())).permute(2, 0, 1))


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "RGB"])
def test_the_fast_path_converts_to_rgb_as_pillow_does(mode):
    """PNG through torchvision and through Pillow: the same tensor, whatever the PNG's colour type."""
    data = encoded(pixels(1, mode), ".png")
    assert torch.equal(decode(data), as_pillow_reads_it(data))


def test_jpeg_and_png_take_torchvisions_decoders(monkeypatch):
    import goodput.data.dataset as dataset

    calls = []
    fast = dataset.decode_image
    monkeypatch.setattr(dataset, "decode_image", lambda *a, **kw: calls.append(1) or fast(*a, **kw))
    for ext in (".jpg", ".png", ".bmp", ".webp"):
        decode(encoded(pixels(), ext))
    assert len(calls) == 2


def test_a_file_that_is_no_image_is_one_line_naming_it(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "train" / "a" / "broken.jpg").write_bytes(b"not an image at all")
    store = Storage(str(tmp_path))
    ds = ImageDataset(RemoteSource(store), ImageFolder(store, "train"), 16, 0, False, "error")
    with pytest.raises(BadSampleError) as e:
        ds[0]
    msg = str(e.value)
    assert (
        f"cannot decode {tmp_path}/train/a/broken.jpg as an image (not an image format Pillow reads)" in msg
    )
    assert "\n" not in msg and "0x" not in msg  # no C++ source path, no object address


def test_an_ignored_file_names_the_extensions_that_are_images(tmp_path, caplog):
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "train" / "a" / "x.png").write_bytes(encoded(pixels(), ".png"))
    (tmp_path / "train" / "a" / "notes.txt").write_text("hi")
    with caplog.at_level(logging.WARNING):
        ImageFolder(Storage(str(tmp_path)), "train")
    assert "notes.txt" in caplog.text and ".webp .bmp" in caplog.text


# -- refusals -----------------------------------------------------------------------------------
def test_a_dataset_smaller_than_one_global_batch_says_the_numbers_and_the_key(thirty, tmp_path):
    with pytest.raises(DatasetTooSmall) as e:
        loader(thirty, tmp_path, global_batch=64)
    assert isinstance(e.value, UserError)
    assert "30 samples, fewer than one global batch (trainer.global_batch_size=64)" in str(e.value)
    assert "trainer.global_batch_size to at most 30" in str(e.value)


def test_a_class_mismatch_names_the_classes_each_side_lacks():
    with pytest.raises(DataRootError) as e:
        check_same_classes(["cat", "dog", "owl"], ["cat", "dgo", "owl"], "/data/pets")
    assert str(e.value) == (
        "/data/pets: train/ and val/ must hold the same classes; only in train/: ['dog'], "
        "only in val/: ['dgo']"
    )
    check_same_classes(["a", "b"], ["a", "b"], "/x")


def test_a_bad_file_in_a_dataloader_worker_is_the_workers_one_line(thirty, tmp_path):
    """torch re-raises a worker's exception with the worker's traceback pasted into its message;
    that message is what the entry point prints. And the workers are gone once it is raised (at
    interpreter exit they were killed, which printed a traceback of its own)."""
    root = tmp_path / "data"
    shutil.copytree(thirty, root)
    victim = sorted((root / "train").rglob("*.jpg"))[0]
    victim.write_bytes(b"garbage")
    ld = loader(root, tmp_path / "cache", global_batch=30, workers=2)
    with pytest.raises(BadSampleError) as e:
        next(ld)
    msg = str(e.value)
    assert msg.startswith(f"cannot decode {victim} as an image"), msg
    assert "\n" not in msg and "Traceback" not in msg and "worker" not in msg
    assert e.value.__cause__ is None and e.value.__context__ is None
    assert mp.active_children() == []  # the refusal ends the run: its workers are stopped already
    ld.close()


# -- drop_last ----------------------------------------------------------------------------------
def test_a_drop_over_a_tenth_of_each_epoch_is_said_with_the_numbers():
    note = dropped_per_epoch(240, 128, 1)
    assert note.startswith("240 training samples, global batch 128: each epoch uses 128 and drops 112 (47%")
    assert "trainer.global_batch_size=120 drops 0" in note
    assert "trainer.global_batch_size=112 drops 16" in dropped_per_epoch(240, 128, 16)  # divisible by 16
    assert dropped_per_epoch(5000, 128, 1) is None  # 8 of 5000
    assert dropped_per_epoch(200, 16, 1) is None  # experiment=smoke: 8 of 200, exactly 4 %
    assert dropped_per_epoch(7, 4, 4).endswith("add samples")


def test_the_loader_warns_once_on_rank_zero(thirty, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="goodput.data.loader"):
        loader(thirty, tmp_path, global_batch=16).close()
        loader(thirty, tmp_path, global_batch=16, rank=1, world=2).close()
        loader(thirty, tmp_path, global_batch=15).close()  # 30 / 15: nothing dropped
    got = [r.getMessage() for r in caplog.records if "drops" in r.getMessage()]
    assert got == [
        "30 training samples, global batch 16: each epoch uses 16 and drops 14 (47%, a different 14 each "
        "epoch: the order is reshuffled). To use more of each epoch: trainer.global_batch_size=15 drops 0, "
        "or add samples"
    ]
