"""The model in MLflow: at the end of a run, rank 0 logs the weights of one committed checkpoint
(`mlflow.log_model`: the final one, or the best of checkpoint.keep_best_by) as an MLflow PyTorch
model with a signature and an input example, tagged with its model_sha256 and checkpoint step, and
registers it when `mlflow.registered_model_name` is set.

It is logged as the pickled module (`serialization_format="pickle"`), not MLflow 3's default
torch.export program: `mlflow.pytorch.load_model` then returns the model class itself, an
`nn.Module` whose `.eval()`, `.to()` and `state_dict()` work (the exported program's `.eval()`
raises NotImplementedError), with the run's model record (goodput.checkpoint.spec: class names,
image size, normalization, the `_target_` node) as its `goodput` attribute and in the MLmodel
metadata. The price: loading it unpickles, so it runs code from the artifact store
(docs/security.md); the checkpoint and the safetensors export stay the pickle-free ways.

The weights come from the checkpoint, not from the live model: no collective (rank 0 alone, after
the others are done), no gathering under FSDP, and the tag names exactly the commit they came
from. Training is over when this runs, and it runs on a thread bounded by `timeout_s`
(mlflow.artifact_timeout_s, within the run's end of mlflow.end_timeout_s): an artifact store that
fails or hangs costs a warning, never the finished run (the checkpoint stays the source of truth;
summary.json's mlflow_model_uri is then null; one that hung leaves the MLflow run's end to the
relaunch: goodput.tracking.Tracker.close).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING

import torch
from hydra.utils import instantiate

from goodput import logs
from goodput.checkpoint.export import model_state
from goodput.model import model_sha256

if TYPE_CHECKING:
    from goodput.checkpoint.spec import ModelSpec
    from goodput.config import Config

log = logging.getLogger(__name__)

SOURCES = ("final", "best", "none")


def log_model(
    c: Config,
    run_id: str | None,
    ckpt,
    example: torch.Tensor,
    spec: ModelSpec,
    timeout_s: float = 600.0,
    missed: list[str] | None = None,
) -> str | None:
    """Log (and maybe register) the model of the run's final or best commit to MLflow run `run_id`,
    with `spec` (the run's model record); returns its model URI (`models:/...`, for
    mlflow.pytorch.load_model), or None when off or when logging failed. Past `timeout_s`, "the
    model" is added to `missed` (the tracker's: the run's end was not logged in time)."""
    source, name = c.mlflow.log_model, c.mlflow.registered_model_name
    if source == "none" or run_id is None:
        return None
    step = ckpt.best.step if source == "best" else ckpt.last_committed_step
    if step is None:
        log.warning("mlflow.log_model=%s: no committed checkpoint to log (keep_best_by off?)", source)
        return None
    out: list = [None]

    def work():
        try:
            out[0] = _log(c, run_id, ckpt, step, source, name, example, spec)
        except Exception as e:
            log.warning(
                "could not log the model of step %d to MLflow (%s: %s); the checkpoint %s is the model",
                step, type(e).__name__, e, ckpt.storage.url(f"step-{step:09d}"),
            )  # fmt: skip

    if bounded(work, timeout_s, "logging the model to MLflow"):
        return out[0]
    if missed is not None:
        missed.append("the model")
    return None


def bounded(fn, timeout_s: float, what: str) -> bool:
    """Run `fn` on a daemon thread for at most `timeout_s`; False (and a warning) when it did not
    end by then. The end of a run waits on the artifact store only this long: the watchdog is
    stopped by then (goodput.run.worker), so nothing else would bound a store that hangs."""
    th = threading.Thread(target=fn, name=f"mlflow: {what}", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        log.warning("%s took over %.0f s: gave up (the checkpoint stays)", what, timeout_s)
        return False
    return True


@contextlib.contextmanager
def fluent_store(uri: str):
    """MLflow's fluent API (mlflow.start_run, log_model) pointed at `uri` for the block.
    mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI, which the config reads
    (`mlflow.tracking_uri: ${oc.env:MLFLOW_TRACKING_URI,...}`): left set, the next job in this
    process (a -m sweep's, on Hydra's basic launcher) took this run's store for its own. Put back."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


def _log(c, run_id, ckpt, step, source, registered_name, example, spec) -> str:
    import mlflow
    import mlflow.pytorch
    from mlflow.models import infer_signature

    rec = next((r for r in ckpt.committed() if r["step"] == step), None)
    if rec is None:
        raise FileNotFoundError(f"no committed checkpoint of step {step}")
    eval_on = c.trainer.eval_on  # the weights the run evaluated
    model = instantiate(c.model, num_classes=spec.num_classes)
    model.load_state_dict(model_state(ckpt.storage, rec, eval_on))
    model.eval()
    model.goodput = spec.record()  # pickled with the module: the loaded model says how to feed it
    x = example.detach().cpu().float().numpy()
    with torch.no_grad():
        y = model(example.detach().cpu().float()).numpy()
    sha = model_sha256(model)
    tags = {"model_sha256": sha, "checkpoint_step": str(step), "checkpoint": ckpt.storage.url(rec["dir"]),
            "weights": source, "eval_on": eval_on}  # fmt: skip
    # MLflow warns on every pickled model; pickling is this module's documented choice (docstring).
    pickled = logs.known_log_line("mlflow.pytorch", "Saving pytorch model by Pickle")
    with fluent_store(c.mlflow.tracking_uri), mlflow.start_run(run_id=run_id), pickled:
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            signature=infer_signature(x, y),
            input_example=x,
            serialization_format="pickle",  # an nn.Module when loaded (see the module docstring)
            metadata={"goodput": spec.record()},
            registered_model_name=registered_name,
            # Given, not inferred: inference loads the model in a fresh interpreter (seconds).
            pip_requirements=mlflow.pytorch.get_default_pip_requirements(),
            tags=tags,
            step=step,
        )
        mlflow.set_tags({f"model.{k}": v for k, v in tags.items()} | {"model.uri": info.model_uri})
    log.info(
        "MLflow model %s: %s weights of step %d (%s), model_sha256 %s",
        info.model_uri,
        eval_on,
        step,
        source,
        sha,
    )
    return info.model_uri
