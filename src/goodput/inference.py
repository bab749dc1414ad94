"""Use a trained model: load it, with what it takes to feed it, from any of the places a run leaves
it, then classify image files (scripts/predict.py) or evaluate it on a split of its data
(scripts/evaluate.py).

A *source* is a run's checkpoint dir (its newest commit whose bytes verify), one step dir of it, a
safetensors export (`inspect_checkpoint.py --export`), or an MLflow model URI (`models:/...`,
`runs:/...`). The first three are read without unpickling anything: tensors checked against their
record, the model rebuilt from the model record (goodput.checkpoint.spec) under its rules. An
MLflow model is a pickled module: loading it runs code from the artifact store (docs/security.md).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from goodput.checkpoint.export import SourceError, read_weights
from goodput.checkpoint.spec import ModelSpec, SpecError, check_node, one_line
from goodput.data.dataset import IMAGE_EXTENSIONS, ImageFolder
from goodput.data.dataset import decode as decode_bytes
from goodput.errors import UserError
from goodput.model import model_sha256
from goodput.storage.remote import check_url
from goodput.untrusted import UnsafePath, confined, printable, real_root, regular

log = logging.getLogger(__name__)

MLFLOW_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:/")


class InputError(UserError, ValueError):
    """An image to classify that is not there or does not decode; a split the data lacks."""


@dataclass
class Loaded:
    """A model ready for inference (eval mode, on `device`) and where it came from."""

    model: nn.Module
    spec: ModelSpec
    origin: str  # the step dir, the file or the model URI
    step: int | None
    weights: str  # model, ema, or what the MLflow model was logged with
    commit: dict | None = None  # the commit record, for a checkpoint source

    @property
    def sha256(self) -> str | None:
        return model_sha256(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def integer(least: int):
    """An argparse type: an integer >= `least` (a usage error naming the flag, not a traceback later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value

    return parse


def is_mlflow(source: str) -> bool:
    return source.startswith(MLFLOW_SCHEMES)


def load(
    source: str, weights: str | None = None, step: int | None = None, device: str = "cpu",
    allow: tuple[str, ...] = (),
) -> Loaded:  # fmt: skip
    """The model of `source`. `weights`: model or ema (checkpoint sources; None = the weights the run
    evaluated, trainer.eval_on); `step`: a commit of a checkpoint dir; `allow`: model `_target_`s to
    build besides nn.Module classes and torchvision builders."""
    if is_mlflow(source):
        return _load_mlflow(source, device)
    got = read_weights(source, weights, step)
    spec = got.spec()
    model = spec.build(allow, got.origin)
    try:
        model.load_state_dict(got.state)
    except RuntimeError as e:  # strict: names every missing and unexpected key, and shape
        raise SpecError(
            f"{got.origin}: the weights do not fit its model record, {spec.call()}: {one_line(e, 600)}"
        ) from None
    return Loaded(model.eval().to(device), spec, got.origin, got.step, got.weights, got.commit)


def _load_mlflow(uri: str, device: str) -> Loaded:
    import mlflow.pytorch
    from mlflow.models import get_model_info

    try:
        info = get_model_info(uri)
    except Exception as e:
        raise SourceError(f"{uri}: no MLflow model there ({type(e).__name__}: {str(e)[:300]})") from None
    spec = ModelSpec.parse((info.metadata or {}).get("goodput"), f"MLflow model {uri}")
    model = mlflow.pytorch.load_model(uri, map_location="cpu")  # unpickles: docs/security.md
    if not isinstance(model, nn.Module):
        raise SpecError(f"MLflow model {uri} loads as a {type(model).__name__}, not an nn.Module")
    tags = getattr(info, "tags", None) or {}
    step = tags.get("checkpoint_step")
    return Loaded(model.eval().to(device), spec, uri, int(step) if str(step).isdigit() else None,
                  tags.get("eval_on", "logged"))  # fmt: skip


# -- images --------------------------------------------------------------------------------------
def image_files(paths: list[str]) -> list[str]:
    """The files named, and under each folder named every file with an image extension (the list
    training uses, goodput.data.dataset.IMAGE_EXTENSIONS), in sorted order. A file named directly is
    taken whatever its extension: Pillow decides whether it is an image. Images are read as training
    reads them (goodput.untrusted): from regular files only, never through a symbolic link. One named
    directly that is a link or a special file (a FIFO would block the read forever) is refused; in a
    folder, such entries (links to folders too) are skipped, counted in one warning per folder."""
    out = []
    for p in paths:
        if os.path.isdir(p):  # (the folder itself may be a link: whoever named it chose it)
            found, skipped, root = [], [], real_root(p)
            for d, dirs, names in os.walk(p):
                skipped += [os.path.join(d, n) for n in dirs if os.path.islink(os.path.join(d, n))]
                for n in names:
                    if not n.lower().endswith(tuple(IMAGE_EXTENSIONS)):
                        continue
                    path = os.path.join(d, n)
                    try:
                        regular(confined(root, os.path.relpath(path, p), p, resolved=True), p)
                    except (UnsafePath, FileNotFoundError):  # a link, a FIFO, a device; gone meanwhile
                        skipped.append(path)
                        continue
                    found.append(path)
            if skipped:
                log.warning(
                    "%s: skipped %d entr%s that %s symbolic links or special files (images are read from "
                    "regular files only, as in training): %s%s", p, len(skipped),
                    "y" if len(skipped) == 1 else "ies", "is" if len(skipped) == 1 else "are",
                    ", ".join(sorted(skipped)[:5]), " ..." if len(skipped) > 5 else "",
                )  # fmt: skip
            if not found:
                raise InputError(
                    f"{p}: no image files in this folder (looked for {', '.join(sorted(IMAGE_EXTENSIONS))})"
                )
            out += sorted(found)
        elif os.path.lexists(p):
            out.append(_regular(p))
        else:
            raise InputError(f"{p}: no such file or folder")
    return out


def _regular(path: str) -> str:
    """`path` if it is a regular file, else InputError (one line): not read through a link, never
    opened when it is a FIFO or a device."""
    try:
        return regular(path, "image")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or folder") from None
    except UnsafePath as e:
        raise InputError(f"{e} (images are read from regular files only, as in training)") from None


def decode(path: str) -> torch.Tensor:
    """An image file as a uint8 RGB tensor (3 x H x W), decoded as training decodes it
    (goodput.data.dataset.decode: the first frame of an animation, alpha dropped)."""
    with open(_regular(path), "rb") as f:
        data = f.read()
    try:
        return decode_bytes(data)
    except Exception as e:  # Pillow's UnidentifiedImageError, a truncated file, a decompression bomb
        raise InputError(f"{path}: cannot decode as an image ({type(e).__name__}: {e})") from None


@torch.no_grad()
def predict(loaded: Loaded, files: list[str], batch_size: int = 64, top_k: int = 5):
    """The CSV rows: the task's header, then one row per file in order, its path and the task's
    prediction (goodput.recipe.task: classification gives class, probability, top<k>) from the
    model's logits on the eval view of each image (the spec's size and normalization)."""
    tf, device = loaded.spec.transform(), loaded.device
    classes = [printable(c) for c in loaded.spec.classes]  # names from a record: printed escaped
    task = loaded.spec.build_task()
    k = max(1, min(top_k, len(classes)))
    yield task.predict_header(k)
    for i in range(0, len(files), batch_size):
        chunk = files[i : i + batch_size]
        x = torch.stack([tf(decode(f)) for f in chunk]).to(device)
        for f, row in zip(chunk, task.predict(loaded.model(x), classes, k)):
            yield [f, *row]


# -- evaluation of a checkpoint ----------------------------------------------------------------------
def data_of(loaded: Loaded, data_root: str | None) -> tuple[str, dict]:
    """(data root, dataset node) to evaluate `loaded` on: the commit's data record (untrusted: the
    dataset class must be an ImageFolder, goodput's or a subclass), `data_root` overriding its root."""
    rec = (loaded.commit or {}).get("data")
    what = f"{loaded.origin} data record"
    if rec is not None and not isinstance(rec, dict):
        raise SpecError(f"{what}: not an object")
    root = data_root or (rec or {}).get("root")
    if not isinstance(root, str) or not root:
        raise SpecError(f"{loaded.origin} names no dataset (no data record): pass --data-root")
    try:
        check_url(root, "data root")
    except ValueError as e:
        raise SpecError(f"{what}: {e}") from None
    node = (rec or {}).get("dataset") or {"_target_": "goodput.data.dataset.ImageFolder"}
    check_node(node, f"{what}: dataset")
    from hydra.utils import get_object

    try:
        cls = get_object(node["_target_"])
    except Exception as e:
        raise SpecError(f"{what}: dataset {node['_target_']!r} cannot be imported here: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, ImageFolder)):
        raise SpecError(f"{what}: dataset {node['_target_']!r} is not an ImageFolder class: not building it")
    return root, node


def evaluation_loader(loaded: Loaded, root: str, dataset: dict, split: str, batch_size: int, workers: int):
    """The eval loader of `split` under `root` (read straight from it: no cache, nothing written),
    with the spec's eval view; the split must exist and hold the model's classes."""
    from goodput.data.augment import AugmentConfig
    from goodput.data.config import DataConfig
    from goodput.data.loader import eval_loader
    from goodput.data.shards import INDEX
    from goodput.storage.remote import Storage

    store = Storage(root)
    if store.exists(INDEX):  # data.root was a dataset packed ahead of time (pack_shards.py)
        raise InputError(
            f"the dataset at {root} is packed into shards ({store.url(INDEX)}): evaluate.py reads an "
            f"ImageFolder; pass --data-root with the one it was packed from"
        )
    if not store.exists(split):
        raise InputError(
            f"the dataset at {root} has no {split} split (no {store.url(split)}/<class>/<image>)"
        )
    spec = loaded.spec
    cfg = DataConfig(
        source={"_target_": "goodput.data.sources.RemoteSource"}, root=root, dataset=dataset, cache_dir=None,
        image_size=spec.image_size, train_crop_size=spec.image_size, val_crop_size=spec.image_size,
        val_resize_size=spec.resize_size or spec.image_size, num_workers=workers,
    )  # fmt: skip
    norm = AugmentConfig(train=[], mean=spec.mean, std=spec.std)
    loader = eval_loader(cfg, store, batch_size, 0, 1, loaded.device, norm, split=split)
    have = loader.dataset.files.classes
    if have != spec.classes:
        missing, extra = sorted(set(spec.classes) - set(have)), sorted(set(have) - set(spec.classes))
        raise InputError(
            f"{store.url(split)} has classes {have[:20]}, the model was trained on {spec.classes[:20]} "
            f"(missing there: {missing[:10]}, not trained on: {extra[:10]})"
        )
    return loader
