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

import logging
import os
import tempfile
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


def _log(c, run_id, ckpt, step, source, registered_name, example, spec) -> str:
    import mlflow.pytorch
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, RunTag
    from mlflow.models import Model, infer_signature
    from mlflow.tracking.context import registry as context_registry

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
    # Every call goes through one client of this run's store, none through MLflow's fluent API: its
    # tracking URI is process-global, so an upload still going past timeout_s (abandoned, not
    # stopped) would write its remaining calls to whatever store the process points at by then
    # (the next job of a sweep's; MLflow's default ./mlflow.db).
    client = MlflowClient(c.mlflow.tracking_uri)
    run = client.get_run(run_id)
    logged = client.create_logged_model(
        run.info.experiment_id, name="model", source_run_id=run_id, params=run.data.params,
        tags=context_registry.resolve_tags(tags),  # + who and what logged it, as MLflow's own does
    )  # fmt: skip
    model_uri = f"models:/{logged.model_id}"
    record = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                   model_id=logged.model_id)  # fmt: skip
    try:
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=step)])
        _link_metrics(client, run, logged.model_id, step)  # the model's metrics in MLflow's UI
        with tempfile.TemporaryDirectory(prefix="goodput-model-") as tmp, pickled:
            path = os.path.join(tmp, "model")
            mlflow.pytorch.save_model(
                model,
                path,
                mlflow_model=record,
                signature=infer_signature(x, y),
                input_example=x,
                serialization_format="pickle",  # an nn.Module when loaded (see the module docstring)
                metadata={"goodput": spec.record()},
                # Given, not inferred: inference loads the model in a fresh interpreter (seconds).
                pip_requirements=mlflow.pytorch.get_default_pip_requirements(),
            )
            client.log_model_artifacts(logged.model_id, path)
    except BaseException:
        try:
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        except Exception as e:  # (a broken store: the first error is the one to report)
            log.debug("could not mark MLflow model %s failed: %r", logged.model_id, e)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    run_tags = {f"model.{k}": v for k, v in tags.items()} | {"model.uri": model_uri}
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in run_tags.items()])
    if registered_name:
        _register(client, registered_name, logged, run_id, tags)
    log.info(
        "MLflow model %s: %s weights of step %d (%s), model_sha256 %s",
        model_uri,
        eval_on,
        step,
        source,
        sha,
    )
    return model_uri


def _link_metrics(client, run, model_id: str, step: int) -> None:
    """The run's metrics at the model's step, logged again with its model id: what the model's page
    and `search_logged_models("metrics....")` read (MLflow's own log_model does the same)."""
    from mlflow.entities import Metric

    history = [m for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)]
    linked = [
        Metric(m.key, m.value, m.timestamp, m.step, model_id, m.dataset_name, m.dataset_digest, m.run_id)
        for m in history
        if m.step == step and m.model_id is None
    ]
    if linked:
        client.log_batch(run.info.run_id, metrics=linked)


def _register(client, name: str, logged, run_id: str, tags: dict) -> None:
    """A new version of registered model `name` (made if missing) from the logged model, on the
    run's own client. Its source is the artifacts' location, not models:/<id>: the SQL registry
    looks a models:/ source up in the process-global store (MLflow's own TODO there)."""
    import json

    from mlflow.exceptions import MlflowException
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    version = client.create_model_version(name, logged.artifact_location, run_id, tags=tags,
                                          model_id=logged.model_id)  # fmt: skip
    # the logged model's page lists its versions from this tag (MLflow's register_model writes it)
    versions = json.loads(client.get_logged_model(logged.model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    versions.append({"name": version.name, "version": version.version})
    client.set_logged_model_tags(logged.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(versions)})
