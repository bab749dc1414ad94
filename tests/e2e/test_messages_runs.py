"""What the entry point prints, as a SLURM log holds it (stdout and stderr to a file): progress and
evaluation lines, one log format, no known-harmless warning; a dataset of WebP and BMP files trains;
the drop_last warning; data refusals and a swapped `_target_` as one line, exit 2, no traceback.
The in-process side: unit/test_messages.py, unit/test_data_errors.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, entry_env, latest_summary, train_cmd
from PIL import Image

from goodput.data.synthetic import make_dataset

pytestmark = pytest.mark.slow

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) (job|rank\d+) [\w.]+: \S")
PROGRESS = re.compile(r"step (\d+)/12 \(\d+%\)  loss \d+\.\d{4}  lr [\d.e-]+  \d+ img/s  eta \d+(s|m\d\ds)$")


def redirected(root: Path, *overrides: str) -> tuple[int, str]:
    """scripts/train.py on experiment=smoke with stdout and stderr to one file: (exit code, text)."""
    log = root / "job.log"
    root.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        rc = subprocess.run(
            train_cmd(root, *overrides), cwd=REPO, env=entry_env(), stdout=out, stderr=subprocess.STDOUT,
            timeout=300,
        ).returncode  # fmt: skip
    return rc, log.read_text()


def mixed_formats(root: Path) -> Path:
    """3 classes x 10 train / 2 val images: JPEG, then the same pixels as WebP, then as BMP."""
    make_dataset(str(root), num_classes=3, train_per_class=10, val_per_class=2, image_size=16)
    for split in ("train", "val"):
        classes = sorted(p for p in (root / split).iterdir())
        for cls, ext in zip(classes[1:], ("webp", "bmp")):
            for f in sorted(cls.glob("*.jpg")):
                with Image.open(f) as im:
                    im.convert("RGB").save(f.with_suffix(f".{ext}"))
                f.unlink()
    return root


@pytest.fixture(scope="module")
def slurm_log(tmp_path_factory):
    """One run as a SLURM job prints it: evaluating every 6 steps, a progress line at every logged
    step (2), the MLflow model logged (an export reads the DCP checkpoint on one process)."""
    base = tmp_path_factory.mktemp("redirected")
    data = mixed_formats(base / "data")
    rc, text = redirected(
        base / "run", f"data.root={data}", "trainer.eval_every_n_steps=6", "trainer.progress_every_s=0",
        "mlflow.log_model=final",
    )  # fmt: skip
    assert rc == 0, text[-5000:]
    return text, latest_summary(base / "run"), base / "run"


def test_progress_and_evaluation_lines_without_a_terminal(slurm_log):
    lines = slurm_log[0].splitlines()
    steps = [int(m.group(1)) for line in lines if (m := PROGRESS.search(line))]
    assert steps == [2, 4, 6, 8, 10, 12], "\n".join(lines)
    evals = [line for line in lines if "eval at step" in line]
    assert len(evals) == 2 and all(re.search(r"val loss \d+\.\d{4}, accuracy \d\.\d{4}", e) for e in evals)
    assert "eval at step 6:" in evals[0] and "eval at step 12:" in evals[1]


def test_one_log_format_and_no_known_harmless_warning(slurm_log):
    text = slurm_log[0]
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and all(LINE.match(line) for line in lines), [x for x in lines if not LINE.match(x)]
    assert any(" goodput.publish: MLflow model " in line for line in lines)  # the export ran
    assert "torch.distributed is disabled" not in text  # DCP's warning on the one-process read
    assert "Warning" not in text and "py.warnings" not in text, text
    assert "mlflow.system_metrics" not in text  # MLflow's chatter on every run
    assert " INFO job mlflow.store.db.utils: Creating initial MLflow database tables" in text  # kept


def test_the_run_dirs_train_log_holds_the_whole_log(slurm_log):
    """Hydra's file handler was dropped by the worker's logging set-up after the first lines."""
    text, _, root = slurm_log
    (log,) = (root / "runs").rglob("train.log")
    assert log.read_text() == text


def test_a_webp_and_bmp_dataset_trains(slurm_log):
    s = slurm_log[1]
    assert s["steps"] == 12 and s["val"]["val/class/disc"] is not None  # (classes: disc, square, triangle)


def test_the_drop_of_most_of_each_epoch_is_a_warning_with_the_numbers(slurm_log):
    warned = [line for line in slurm_log[0].splitlines() if " WARNING " in line]
    assert len(warned) == 1 and warned[0].endswith(
        "30 training samples, global batch 16: each epoch uses 16 and drops 14 (47%, a different 14 each "
        "epoch: the order is reshuffled). To use more of each epoch: trainer.global_batch_size=15 drops 0, "
        "or add samples"
    ), warned


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    make_dataset(str(root), num_classes=3, train_per_class=6, val_per_class=2, image_size=16)
    return root


def _mismatch(d: Path) -> tuple[list[str], str]:
    (d / "val" / "disc").rename(d / "val" / "zebra")
    return [], "train/ and val/ must hold the same classes; only in train/: ['disc'], only in val/: ['zebra']"


def _undecodable(d: Path) -> tuple[list[str], str]:
    victim = sorted((d / "train").rglob("*.jpg"))[0]
    victim.write_bytes(b"not an image")
    return ["data.num_workers=2"], f"cannot decode {victim} as an image"  # raised in a DataLoader worker


def _too_small(d: Path) -> tuple[list[str], str]:
    return ["trainer.global_batch_size=32"], "18 samples, fewer than one global batch (trainer.global_"


@pytest.mark.parametrize("case", [_mismatch, _undecodable, _too_small], ids=lambda f: f.__name__[1:])
def test_a_data_error_is_one_line_exit_2(case, dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    overrides, names = case(data)
    rc, text = redirected(tmp_path / "run", f"data.root={data}", *overrides)
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert rc == 2 and len(errors) == 1 and names in errors[0], text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert all(LINE.match(x) for x in text.splitlines() if x.strip()), text[-4000:]


@pytest.mark.parametrize(
    "target, said",
    [
        ("torchvision.models.mobilenet_v3_small",
         ["model.width (from conf/model/small_cnn.yaml) would be passed to torchvision.models",
          "selected with model=<name>", "~model.width"]),
        ("torchvision.models.resnt18", ["model._target_=torchvision.models.resnt18: no such object"]),
    ],
)  # fmt: skip
def test_a_swapped_or_misspelt_target_fails_before_any_work(tmp_path, target, said):
    rc, text = redirected(tmp_path / "run", f"model._target_={target}")
    lines = [line for line in text.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, text
    assert all(part in lines[0] for part in said), lines[0]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["job.log", "runs"]  # no data, store, run
