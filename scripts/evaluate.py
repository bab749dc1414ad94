"""Evaluate a checkpoint on its run's validation (or test) split, in one process, and record it in MLflow.

python scripts/evaluate.py outputs/checkpoints/demo-1a2b3c4d            # the newest commit that verifies
python scripts/evaluate.py outputs/checkpoints/demo --step 250 --weights ema   # the one demo-<digest> there
python scripts/evaluate.py outputs/checkpoints/demo-1a2b3c4d/step-000000300 --split test

A run's dir is `<experiment>-<digest>` (docs/config.md, run identity): a path that is not there but
names exactly one such dir beside it (`outputs/checkpoints/demo` for `demo-1a2b3c4d`) is taken as
that dir, saying so; with several, one line lists them, newest first.

Any backend and any world size the checkpoint was saved on (DCP shards are gathered on this one
process). The model, the class names, the image size, the normalization and the data come from the
checkpoint's commit record (a run records them in every commit; `--data-root` points elsewhere if
the data moved). It prints loss, accuracy, top-k and the per-class table, and logs the same metrics,
`per_class.csv` and `confusion_matrix.png` as an MLflow run nested under the training run (tags
`goodput.evaluates=<training run id>`, `goodput.checkpoint`, `goodput.checkpoint_step`,
`goodput.weights`, `goodput.split`, `goodput.model_sha256`), in the run's own store (the mlflow.db of
the paths.root the checkpoint dir is under) unless --tracking-uri or MLFLOW_TRACKING_URI says
otherwise. The metrics are the task's (the run's `task`, from the record: for multilabel F1 and
mAP). A split the dataset lacks, a step that
is not committed, a directory without checkpoints: one line, exit 2.
"""

import argparse
import atexit
import gc
import json
import logging
import os
import sys
import tempfile

from goodput.checkpoint.export import run_dir
from goodput.errors import UserError
from goodput.inference import data_of, evaluation_loader, integer, load
from goodput.run.evaluate import evaluate
from goodput.untrusted import printable

DEFAULT_STORE = "sqlite:///outputs/mlflow.db"  # the default job's store, from the repository root


def default_store(checkpoint: str) -> str:
    """MLFLOW_TRACKING_URI, else the run's own store: `<root>/mlflow.db` when the checkpoint lies
    under `<root>/checkpoints/<run>` (a paths.root's checkpoint dir: [/<trial>][/step-N] below it),
    else DEFAULT_STORE. Found from the path you gave, never from what a record says, and never from
    an mlflow.db that merely sits in some folder above it: that store is somebody else's."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if "://" not in checkpoint:
        here = os.path.abspath(checkpoint)
        while (up := os.path.dirname(here)) != here:  # each `checkpoints` folder above the run's dir
            if os.path.basename(up) == "checkpoints":  # (a run may be named `checkpoints` too)
                store = os.path.join(os.path.dirname(up), "mlflow.db")
                if os.path.isfile(store):
                    return f"sqlite:///{store}"
            here = up
    return DEFAULT_STORE


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a run's checkpoint dir, one step dir in it, or a .safetensors export")
    p.add_argument("--step", type=integer(0), help="which commit of the checkpoint dir (default: the newest)")
    p.add_argument(
        "--weights", choices=["model", "ema"], help="default: what the run evaluated (trainer.eval_on)"
    )
    p.add_argument("--split", default="val", choices=["val", "test"])
    p.add_argument("--data-root", help="the dataset (default: the run's data.root, from the commit record)")
    p.add_argument(
        "--top-k", type=integer(1), help="k of <split>/top<k> (default: the run's; 5 from 5 classes up)"
    )
    p.add_argument("--batch-size", type=integer(1), default=64)
    p.add_argument("--workers", type=integer(0), default=0, help="DataLoader processes (0 = this one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="also keep per_class.csv and confusion_matrix.png in this folder")
    p.add_argument("--tracking-uri", help=f"the MLflow store (default: the run's own, else {DEFAULT_STORE})")
    p.add_argument("--no-mlflow", action="store_true", help="print only")
    p.add_argument("--allow-target", action="append", default=[], help="trust this model _target_ too")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        a.checkpoint = run_dir(a.checkpoint, say=lambda line: print(f"evaluate.py: {line}", file=sys.stderr))
        a.tracking_uri = a.tracking_uri or default_store(a.checkpoint)
        return run(a)
    except UserError as e:  # the checkpoint, the step, the split, the data: said in one line
        print(f"evaluate.py: {printable(e)}", file=sys.stderr)
        return 2


def run(a) -> int:
    m = load(a.checkpoint, a.weights, a.step, a.device, tuple(a.allow_target))
    root, dataset = data_of(m, a.data_root)
    loader = evaluation_loader(m, root, dataset, a.split, a.batch_size, a.workers)
    n, task = m.spec.num_classes, m.spec.build_task(tuple(a.allow_target))
    if a.top_k and hasattr(task, "top_k"):
        task.top_k = a.top_k
    ev = evaluate(m.model, loader, m.device, 1, task.metrics(m.spec.classes, a.split))
    metrics = ev.compute()
    sha = m.sha256
    with tempfile.TemporaryDirectory() as tmp:
        files = ev.report(a.out or tmp)
        run_id = None if a.no_mlflow else log_run(a, m, metrics, files, sha, root)
    if a.json:
        about = {"checkpoint": m.origin, "step": m.step, "weights": m.weights, "split": a.split}
        print(
            json.dumps(
                {**about, "samples": ev.count, "model_sha256": sha, "mlflow_run_id": run_id, **metrics}
            )
        )
        return 0
    say(
        f"{m.origin} ({m.weights} weights, step {m.step}) on {root}/{a.split}: {ev.count} images, {n} classes"
    )
    for k, v in metrics.items():
        if "/class/" not in k:
            say(f"  {k:<16} {v:.6f}")
    for line in ev.lines():  # the task's per-class table (class names from the record: escaped)
        say(line)
    print(f"  model_sha256     {sha}")
    if a.out:
        print(f"report: {', '.join(files)}")
    if run_id:
        print(f"MLflow: run {run_id} in {a.tracking_uri}")
    return 0


def say(line: str) -> None:
    """Print a line that holds what a record says (the data root, the weights, the class names):
    escaped, so a `\\r` or an escape sequence in a record cannot rewrite what it shows."""
    print(printable(line))


def log_run(a, m, metrics: dict, files: list[str], sha: str, root: str) -> str:
    """The evaluation as its own MLflow run, nested under the training run when that is in the store."""
    from mlflow.tracking import MlflowClient

    from goodput.tracking import Tracker, source_tags, start_run

    trained = (m.commit or {}).get("mlflow_run_id")
    trained = trained if isinstance(trained, str) else None
    experiment, link = "goodput", {}
    if trained:
        try:
            exp_id = MlflowClient(a.tracking_uri).get_run(trained).info.experiment_id
            experiment = MlflowClient(a.tracking_uri).get_experiment(exp_id).name
            link = {"mlflow.parentRunId": trained}
        except Exception:
            logging.warning("the training run %s is not in %s: the evaluation is not nested under it",
                            trained, a.tracking_uri)  # fmt: skip
    tags = {"goodput.evaluates": trained or "", "goodput.checkpoint": m.origin, "goodput.split": a.split,
            "goodput.checkpoint_step": str(m.step), "goodput.weights": m.weights, "goodput.model_sha256": sha,
            **link, **source_tags(sys.argv[0])}  # fmt: skip
    store = a.tracking_uri[len("sqlite:///") :] if a.tracking_uri.startswith("sqlite:///") else None
    artifacts = os.path.join(os.path.dirname(os.path.abspath(store)), "mlartifacts") if store else None
    run_name = f"evaluate step {m.step} {a.split}"
    params = {"checkpoint": m.origin, "split": a.split, "weights": m.weights, "data_root": root}
    run_id = start_run(a.tracking_uri, experiment, run_name, params, None, artifacts, tags=tags)
    tracker = Tracker(a.tracking_uri, run_id, enabled=True)
    tracker.log(metrics, m.step or 0)
    for path in files:
        tracker.artifact(path, "evaluation")
    tracker.close("FINISHED")
    return run_id


if __name__ == "__main__":
    atexit.register(gc.freeze)  # a fast exit: see scripts/train.py
    sys.exit(main())
