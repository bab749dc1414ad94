"""MLflow: one run per job, continued across restarts (its id lives in the checkpoint).

Metrics are queued and written by a background thread in batches, so logging never stalls the
loop (and never inflates fetch_seconds); `close()` flushes. Only rank 0 tracks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


def _retry(fn, *args, tries: int = 10, **kw):
    """SQLite stores answer 'database is locked' when parallel jobs write at once: back off, retry."""
    for i in range(tries):
        try:
            return fn(*args, **kw)
        except Exception as e:
            if i == tries - 1 or "locked" not in str(e).lower():
                raise
            time.sleep(0.2 * (i + 1))


def get_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    exp = _retry(client.get_experiment_by_name, name)
    if exp is not None:
        return exp.experiment_id
    try:
        # Without a location MLflow puts artifacts in ./mlruns of whatever the current directory is.
        return _retry(client.create_experiment, name, artifact_location=artifact_location)
    except Exception:  # another job created it between our two calls
        exp = _retry(client.get_experiment_by_name, name)
        if exp is None:
            raise
        return exp.experiment_id


def start_run(
    uri: str,
    experiment: str,
    run_name: str,
    params: dict,
    run_id: str | None,
    artifact_location: str | None = None,
) -> str:
    """Create the job's run (or continue `run_id`). Called once, before any worker starts."""
    client = MlflowClient(uri)
    if run_id is not None:
        try:
            client.get_run(run_id)
            client.set_tag(run_id, "resumed", "true")
            return run_id
        except Exception:
            log.warning("MLflow run %s from the checkpoint is not in %s: starting a new run", run_id, uri)
    exp_id = get_or_create_experiment(client, experiment, artifact_location)
    run = _retry(client.create_run, exp_id, run_name=run_name)
    items = [Param(k[:250], v[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        _retry(client.log_batch, run.info.run_id, params=items[i : i + 100])
    return run.info.run_id


class Tracker:
    def __init__(self, uri: str | None, run_id: str | None, enabled: bool):
        self.enabled = enabled and uri is not None and run_id is not None
        self.run_id = run_id
        if not self.enabled:
            return
        self.client = MlflowClient(uri)
        self._q: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="mlflow-log", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            ts = int(time.time() * 1000)
            for k, v in metrics.items():
                self._q.put(Metric(k, float(v), ts, step))

    def _drain(self) -> None:
        while True:
            got = [self._q.get()]
            self._closing.wait(0.5)  # let a batch gather (not when closing: a failed rank exits fast)
            while not self._q.empty() and len(got) < 900:
                got.append(self._q.get_nowait())
            batch = [m for m in got if m is not None]
            if batch:
                try:
                    _retry(self.client.log_batch, self.run_id, metrics=batch)
                except Exception as e:
                    log.warning("MLflow logging failed (%s); training goes on", e)
            for _ in got:
                self._q.task_done()
            if len(batch) < len(got):  # the None sentinel: close() was called
                return

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled:
            for k, v in tags.items():
                _retry(self.client.set_tag, self.run_id, k, str(v))

    def artifact(self, path: str, subdir: str | None = None) -> None:
        if self.enabled:
            try:
                _retry(self.client.log_artifact, self.run_id, path, subdir)
            except Exception as e:
                log.warning("could not log artifact %s: %s", path, e)

    def artifacts(self, path: str, subdir: str | None = None) -> None:
        if self.enabled:
            try:
                _retry(self.client.log_artifacts, self.run_id, path, subdir)
            except Exception as e:
                log.warning("could not log artifacts %s: %s", path, e)

    def flush(self) -> None:
        if self.enabled:
            self._q.join()

    def close(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self._closing.set()
            self._q.put(None)
            self._thread.join(timeout=60)
            _retry(self.client.set_terminated, self.run_id, status)
            self.enabled = False
