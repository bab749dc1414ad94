"""A learnable, procedurally generated image dataset written as JPEGs: `shapes` (an ImageFolder) or
`multilabel` (a manifest per split).

Each class is a shape (disc, square, triangle, ...) drawn at a random position, size and colour over a
noisy background, so a small CNN learns it in a few hundred steps but not instantly. `multilabel`
draws one to three different shapes, smaller, into each image, and lists its labels in
`<split>.csv` (`path,labels`, labels `;`-joined: goodput.recipe.datasets.MultilabelManifest).
Deterministic from the seed: image i of split s comes from numpy's PCG64 seeded with (seed, s, i).
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageDraw

from goodput.resilience.lock import _pid_alive

# Written last, after train/ and val/ are in place: a dataset without it is partial (the generator
# was killed) and is never trained on (goodput.run.job.ensure_data regenerates it).
COMPLETE = "DATASET.json"
REPLACING = "DATASET.replacing"  # in a folder while a dataset's splits replace its old ones
SHAPES = ["disc", "square", "triangle", "cross", "hbars", "vbars", "ring", "diamond", "checker", "dots"]


KINDS = ("shapes", "multilabel")


def _draw(shape: str, size: int, rng: np.random.Generator) -> Image.Image:
    img = _background(size, rng)
    _shape(ImageDraw.Draw(img), shape, size, rng, 0.22, 0.38)
    return img


def _draw_many(shapes: list[str], size: int, rng: np.random.Generator) -> Image.Image:
    img = _background(size, rng)
    d = ImageDraw.Draw(img)
    for shape in shapes:
        _shape(d, shape, size, rng, 0.14, 0.22)
    return img


def _background(size: int, rng: np.random.Generator) -> Image.Image:
    bg = rng.integers(0, 256, 3)
    noise = rng.normal(0, 24, (size, size, 3))
    arr = np.clip(bg[None, None, :] * 0.5 + 64 + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def _shape(d: ImageDraw.ImageDraw, shape: str, size: int, rng: np.random.Generator, lo: float, hi: float):
    color = tuple(int(c) for c in rng.integers(0, 256, 3))
    r = max(2, int(size * rng.uniform(lo, hi)))
    cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
    box = [cx - r, cy - r, cx + r, cy + r]
    w = max(2, size // 12)
    if shape == "disc":
        d.ellipse(box, fill=color)
    elif shape == "square":
        d.rectangle(box, fill=color)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    elif shape == "cross":
        d.rectangle([cx - w, cy - r, cx + w, cy + r], fill=color)
        d.rectangle([cx - r, cy - w, cx + r, cy + w], fill=color)
    elif shape == "hbars":
        for y in range(cy - r, cy + r, 3 * w):
            d.rectangle([cx - r, y, cx + r, y + w], fill=color)
    elif shape == "vbars":
        for x in range(cx - r, cx + r, 3 * w):
            d.rectangle([x, cy - r, x + w, cy + r], fill=color)
    elif shape == "ring":
        d.ellipse(box, outline=color, width=w)
    elif shape == "diamond":
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=color)
    elif shape == "checker":
        step = max(2, r // 2)
        for i, x in enumerate(range(cx - r, cx + r, step)):
            for j, y in enumerate(range(cy - r, cy + r, step)):
                if (i + j) % 2 == 0:
                    d.rectangle([x, y, x + step - 1, y + step - 1], fill=color)
    elif shape == "dots":
        for _ in range(6):
            x, y = (int(v) for v in rng.integers(cx - r, cx + r, 2))
            d.ellipse([x - w, y - w, x + w, y + w], fill=color)


def make_dataset(
    root: str,
    num_classes: int = 10,
    train_per_class: int = 500,
    val_per_class: int = 100,
    image_size: int = 32,
    seed: int = 0,
    quality: int = 90,
    threads: int = 4,
    test_per_class: int = 0,
    kind: str = "shapes",
) -> dict:
    """Write `root/{train,val}/<class>/<i>.jpg` (and `test/` with `test_per_class` > 0: a held-out
    split training never reads, for scripts/evaluate.py --split test) and then `root/DATASET.json`.
    `kind="multilabel"`: `root/<split>/<i>.jpg` and `root/<split>.csv`, num_classes x *_per_class
    images a split. Returns counts. Local paths only (it is a demo volume).

    Generated aside (`<root>.partial-<pid>`) and moved into place, so a kill at any moment leaves
    either no dataset or a complete one; a relaunch starts over."""
    if not 1 <= num_classes <= len(SHAPES):
        raise ValueError(f"num_classes must be in [1, {len(SHAPES)}], got {num_classes}")
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8, got {image_size}")
    if test_per_class < 0:
        raise ValueError(f"test_per_class must be >= 0, got {test_per_class}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    root = os.path.abspath(root)
    for stale in glob.glob(f"{glob.escape(root)}.partial-*"):  # left by killed generators
        if _dead(stale.rsplit("-", 1)[-1]):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = f"{root}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    jobs = []
    splits = [("train", train_per_class), ("val", val_per_class), ("test", test_per_class)]
    splits = [(i, split, n) for i, (split, n) in enumerate(splits) if split != "test" or n > 0]
    multi = kind == "multilabel"
    for split_id, split, n in splits:
        for c in range(num_classes):
            os.makedirs(os.path.join(tmp, split, "" if multi else SHAPES[c]), exist_ok=True)
            jobs += [(split_id, split, c, i) for i in range(n)]

    def write(job):
        split_id, split, c, i = job
        rng = np.random.default_rng([seed, split_id, c, i])
        buf = io.BytesIO()
        if multi:  # image c*n+i: one to three different shapes
            shapes = [SHAPES[k] for k in sorted(rng.choice(num_classes, rng.integers(1, 4), replace=False))]
            _draw_many(shapes, image_size, rng).save(buf, format="JPEG", quality=quality)
            rel = f"{split}/{c:03d}{i:06d}.jpg"
        else:
            shapes = [SHAPES[c]]
            _draw(SHAPES[c], image_size, rng).save(buf, format="JPEG", quality=quality)
            rel = f"{split}/{SHAPES[c]}/{i:06d}.jpg"
        with open(os.path.join(tmp, rel), "wb") as f:
            f.write(buf.getvalue())
        return split, rel, shapes

    with ThreadPoolExecutor(threads) as pool:
        written = list(pool.map(write, jobs))
    if multi:  # the manifests, in the order the images were listed (goodput.recipe.datasets)
        for _, split, _ in splits:
            with open(os.path.join(tmp, f"{split}.csv"), "w") as f:
                f.write("path,labels\n")
                f.writelines(f"{rel},{';'.join(shapes)}\n" for s, rel, shapes in written if s == split)
    counts = {split: num_classes * n for _, split, n in splits}  # (no "test" without one: the
    # default job's record, and so its data, stay what they were)
    record = {**counts, "num_classes": num_classes, "image_size": image_size, "seed": seed}
    if multi:  # (the default kind is not recorded: the data of earlier runs stays what it was)
        record["kind"] = kind
    with open(os.path.join(tmp, COMPLETE), "w") as f:
        json.dump(record, f)
    _move_into_place(tmp, root, record)
    return {**counts, "root": root}


def read_record(root: str) -> dict | None:
    """The completion record of a generated dataset, or None (absent: partial or not generated)."""
    try:
        with open(os.path.join(root, COMPLETE)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def foreign_files(root: str) -> list[str]:
    """What makes `root` a folder the demo data may not be generated into: its entries, when it
    holds any and is neither a generated dataset (its record) nor one being replaced (the marker
    a killed generator leaves). Empty: generating there writes over nobody's files."""
    try:
        names = sorted(n for n in os.listdir(root) if not n.startswith("."))  # .DS_Store and the like
    except FileNotFoundError:
        return []
    if COMPLETE in names or REPLACING in names:
        return []
    return names


def _dead(pid: str) -> bool:
    return not pid.isdigit() or not _pid_alive(int(pid))


def _move_into_place(tmp: str, root: str, record: dict) -> None:
    try:
        os.rename(tmp, root)  # atomic: root did not exist, or was an empty folder
        return
    except OSError:
        pass
    if read_record(root) == record:  # a concurrent job finished the same dataset first: keep it
        shutil.rmtree(tmp, ignore_errors=True)
        return
    # root holds other things (or an older dataset): replace train/ and val/, the record last. The
    # marker first, so a kill half way leaves a folder known to be demo data (is_demo_data).
    os.makedirs(root, exist_ok=True)
    open(os.path.join(root, REPLACING), "w").close()
    if os.path.exists(os.path.join(root, COMPLETE)):
        os.remove(os.path.join(root, COMPLETE))
    for split in ("train", "val", "test"):
        shutil.rmtree(os.path.join(root, split), ignore_errors=True)
        if os.path.isdir(os.path.join(tmp, split)):
            os.rename(os.path.join(tmp, split), os.path.join(root, split))
        manifest = os.path.join(root, f"{split}.csv")
        if os.path.isfile(manifest):
            os.remove(manifest)
        if os.path.isfile(os.path.join(tmp, f"{split}.csv")):
            os.rename(os.path.join(tmp, f"{split}.csv"), manifest)
    os.rename(os.path.join(tmp, COMPLETE), os.path.join(root, COMPLETE))
    os.remove(os.path.join(root, REPLACING))
    os.rmdir(tmp)
