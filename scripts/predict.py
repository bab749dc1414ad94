"""Classify image files (or every image under folders) with a trained model; one CSV row per image.

python scripts/predict.py outputs/checkpoints/demo-1a2b3c4d photo.jpg more/  # a run's newest verified commit
python scripts/predict.py outputs/checkpoints/demo photo.jpg          # the one demo-<digest> there
python scripts/predict.py model.safetensors photo.jpg --out predictions.csv  # an inspect_checkpoint.py export
python scripts/predict.py models:/m-0123456789abcdef photo.jpg        # the model a run logged to MLflow

The source carries everything prediction needs (the model's `_target_` and task nodes, class names,
image size, mean and std): a checkpoint in its commit record, an export in its safetensors metadata,
the MLflow model in its metadata. Each image gets the eval view training used (resize, center crop,
normalize); any format Pillow opens works. Images are read from regular files only, as training
reads them: in a folder a symbolic link or a special file (a FIFO) is skipped with a warning, named
directly it is refused. The CSV is the task's (goodput.recipe.task): for classification path, class,
probability, top<k> (`class:probability` pairs, best first, joined by `;`); for multilabel path,
labels (those at or above the threshold, joined by `;`), top<k>. Loading an MLflow model unpickles
it (docs/security.md); the other two sources run no code from the files. A missing or undecodable
image: one line, exit 2. A checkpoint path that is not there but names one run dir
`<it>-<8 hex digits>` beside it is that dir (evaluate.py).
"""

import argparse
import atexit
import csv
import gc
import logging
import os
import sys

from goodput.checkpoint.export import run_dir
from goodput.errors import UserError
from goodput.inference import image_files, integer, load, predict
from goodput.untrusted import printable


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "source", help="a checkpoint dir or step dir, a .safetensors export, or an MLflow model URI"
    )
    p.add_argument("images", nargs="+", help="image files and folders (searched recursively)")
    p.add_argument("--out", help="write the CSV here (default: stdout)")
    p.add_argument("--top-k", type=integer(1), default=5)
    p.add_argument("--step", type=integer(0), help="which commit of a checkpoint dir (default: the newest)")
    p.add_argument("--weights", choices=["model", "ema"], help="checkpoints: default what the run evaluated")
    p.add_argument("--batch-size", type=integer(1), default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"), help="for a models:/ URI")
    p.add_argument("--allow-target", action="append", default=[], help="trust this model _target_ too")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.tracking_uri:
        import mlflow

        mlflow.set_tracking_uri(a.tracking_uri)
    try:
        files = image_files(a.images)
        source = run_dir(a.source, say=lambda line: print(f"predict.py: {line}", file=sys.stderr))
        m = load(source, a.weights, a.step, a.device, tuple(a.allow_target))
        rows = predict(m, files, a.batch_size, a.top_k)
        if a.out:
            with open(a.out, "w", newline="") as f:
                csv.writer(f).writerows(rows)
        else:
            csv.writer(sys.stdout).writerows(rows)
    except UserError as e:
        print(f"predict.py: {printable(e)}", file=sys.stderr)
        return 2
    if a.out:
        print(f"wrote {len(files)} predictions to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    atexit.register(gc.freeze)  # a fast exit: see scripts/train.py
    sys.exit(main())
