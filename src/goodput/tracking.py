"""MLflow: one run per job, continued across restarts (its id lives in the checkpoint).

Metrics, tags and the dataset are queued and written in order by a background thread (metrics in
batches), which also opens the store: logging never stalls the loop (and never inflates
fetch_seconds), and a restart never waits for MLflow; `close()` flushes. Only rank 0 tracks.

Why not MLflow's own asynchronous logging (`log_batch(synchronous=False)`,
MLFLOW_ENABLE_ASYNC_LOGGING): its call also returns without touching the store, but
- a write that fails is logged and dropped: no retry, and the logging function is bound when the
  store is created, so none can be added (a SQLite file locked past MLflow's busy timeout, as
  parallel sweep jobs do, loses metrics; this queue's `_retry` does not);
- by default every call is its own write, on up to 10 writer threads; merging needs
  MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS, a process-wide environment variable;
- its flush and its atexit hook wait without a bound: a store that never answers keeps the process
  from exiting (here the thread is a daemon, and close() waits at most 60 s);
- a call costs more on the loop's side, and single calls stall while its writer threads run.
The side-by-side measurement: docs/benchmarks.md ("MLflow logging").
Forked children (DataLoader workers) are alike in both: they never log, and their copy of the
queue has no thread.
"""

from __future__ import annotations

import glob
import logging
import os
import queue
import sqlite3
import subprocess
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from goodput.resilience.lock import _pid_alive

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

# mlflow is imported where it is used: MlflowConfig, the schema below, is imported whenever Hydra
# composes the config (`--help`, the compose API), which must not pay seconds for mlflow.

log = logging.getLogger(__name__)


@dataclass
class MlflowConfig:
    """Schema of `mlflow`: where the job's run is recorded."""

    tracking_uri: str = "${oc.env:MLFLOW_TRACKING_URI,sqlite:///${paths.root}/mlflow.db}"
    """A SQLite file under paths.root by default (MLflow 3 refuses plain file stores). Many parallel
    jobs on one SQLite file wait on its lock: point them at an `mlflow server` instead."""

    experiment: str = "goodput"
    """MLflow experiment the runs are grouped under."""

    artifact_location: str = "${paths.root}/mlartifacts"
    """Where the experiment stores artifacts; used only when the experiment is first created."""

    log_model: str = "final"
    """At the end of a run, log the weights of this commit as an MLflow model (signature, input
    example, tags model_sha256 and checkpoint_step): `final` (the last step), `best` (the commit of
    checkpoint.keep_best_by), `none`. After training, on its own thread: a failing artifact store
    only warns. summary.json's mlflow_model_uri loads it (mlflow.pytorch.load_model)."""

    artifact_timeout_s: float = 600.0
    """Bound on each upload to the artifact store: identity.json when the run starts, and at its end
    the logged model, then the run's files (summary.json, goodput.png, the evaluation report,
    .hydra/). A store slower than
    that costs a warning and the upload (summary.json's mlflow_model_uri is then null), never the
    finished run: summary.json is written and the MLflow run ends FINISHED whatever the store does."""

    registered_model_name: str | None = None
    """Also register the logged model under this name in the Model Registry (null = don't)."""

    parent_run_id: str | None = None
    """Nest this run under that MLflow run (the `mlflow.parentRunId` tag). Set by the Optuna sweeper
    (hparams_search=...) for each trial: the sweep's parent run groups its trials in the UI."""

    system_metrics_interval_s: float | None = 10.0
    """MLflow's system metrics (system/*: CPU, memory, disk, network; GPU with nvidia-ml-py) sampled
    every this many seconds by rank 0's node, on a thread of MLflow's; null or 0 = off. The
    environment variable MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it (MLflow's rule)."""

    def __post_init__(self):
        if self.system_metrics_interval_s is not None and self.system_metrics_interval_s < 0:
            raise ValueError(
                f"mlflow.system_metrics_interval_s must be >= 0 or null, got {self.system_metrics_interval_s}"
            )
        if not self.artifact_timeout_s > 0:
            raise ValueError(f"mlflow.artifact_timeout_s must be > 0, got {self.artifact_timeout_s}")
        if self.log_model not in ("final", "best", "none"):
            raise ValueError(f"mlflow.log_model must be final|best|none, got {self.log_model!r}")


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


# MLflow 3's UI opens an experiment in its GenAI view (traces, sessions) unless this tag says it holds
# model training runs (or the URL says so: workflowType=machine_learning, see scripts/mlflow_ui.py).
KIND_TAG, KIND_TRAINING = "mlflow.experimentKind", "custom_model_development"


def get_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    exp = _retry(client.get_experiment_by_name, name)
    if exp is not None:
        return exp.experiment_id
    try:
        # Without a location MLflow puts artifacts in ./mlruns of whatever the current directory is.
        tags = {KIND_TAG: KIND_TRAINING}
        return _retry(client.create_experiment, name, artifact_location=artifact_location, tags=tags)
    except Exception:  # another job created it between our two calls
        exp = _retry(client.get_experiment_by_name, name)
        if exp is None:
            raise
        return exp.experiment_id


def source_tags(entry_point: str) -> dict[str, str]:
    """MLflow's source tags: the entry point, and the git commit when it runs from a repository."""
    path = os.path.abspath(entry_point)
    tags = {"mlflow.source.name": path, "mlflow.source.type": "LOCAL"}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=os.path.dirname(path),
            capture_output=True,
            text=True,
            timeout=10,
        )
        if commit.returncode == 0:
            tags["mlflow.source.git.commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass  # no git here: the entry point alone still says what ran
    return tags


def _sqlite_path(uri: str) -> str | None:
    prefix = "sqlite:///"
    return uri[len(prefix) :] if uri.startswith(prefix) and ":memory:" not in uri else None


def _sqlite_state(path: str) -> tuple[str | None, int | None] | None:
    """(schema revision, number of runs) of a SQLite store, read without MLflow: an MLflow engine
    opened on a half-made file stays cached for its path and would outlive moving it aside. None
    when the file cannot be read as it is: locked, or a writer was killed mid-write and left a hot
    journal, which only a read-write open (MLflow's) rolls back."""
    out: list = [None, None]
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
            for i, q in enumerate(("SELECT version_num FROM alembic_version", "SELECT count(*) FROM runs")):
                try:
                    row = con.execute(q).fetchone()
                    out[i] = row[0] if row else None
                except sqlite3.OperationalError as e:
                    if "no such table" not in str(e):
                        return None
    except sqlite3.Error:
        return None
    return out[0], out[1]


def ensure_store(uri: str) -> None:
    """A local SQLite store (the default) is made aside and linked into place, so a job killed
    while MLflow creates and migrates its tables (seconds) never leaves a half-made store at the
    real path. A half-made one found there (made before this existed, or by another tool: not at
    MLflow's schema head and no runs) is moved aside with a warning: it never blocks training. A
    store holding runs is left to MLflow (an older schema: `mlflow db upgrade`). Other stores:
    MLflow's business."""
    path = _sqlite_path(uri)
    if path is None:
        return
    if os.path.exists(path):
        from mlflow.store.db.utils import _get_latest_schema_revision

        state = _sqlite_state(path)
        if state is None:
            return  # what it holds is unknown: never moved aside on a guess
        revision, runs = state
        if revision == _get_latest_schema_revision() or runs:
            return
        aside = f"{path}.broken-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(path, aside)
        for side in ("-journal", "-wal", "-shm"):  # SQLite would play a journal left here into the new store
            if os.path.exists(path + side):
                os.replace(path + side, aside + side)
        log.warning(
            "MLflow store %s is half-made (schema revision %s, no runs: a job was killed while "
            "creating it); moved it to %s and starting a new one",
            path,
            revision,
            aside,
        )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for stale in glob.glob(f"{glob.escape(path)}.creating-*"):  # left by killed jobs (pid is dead)
        pid = stale.split("-")[-1]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            os.unlink(stale)
    tmp = f"{path}.creating-{uuid.uuid4().hex[:8]}-{os.getpid()}"
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        store = SqlAlchemyStore(f"sqlite:///{tmp}", os.path.join(os.path.dirname(path), "mlruns"))
        store.engine.dispose()
        try:
            os.link(tmp, path)  # atomic, and never replaces a store another job linked first
        except FileExistsError:
            pass
    finally:
        for leftover in (tmp, tmp + "-journal"):
            if os.path.exists(leftover):
                os.unlink(leftover)


# Tags the job sets: the run's checkpoint dir (which runs a relaunch holding its lock may close),
# its identity digest (goodput.identity), how many launches it has had, why it did not finish, and
# how often a killed job left it RUNNING.
CHECKPOINT_TAG, IDENTITY_TAG = "goodput.checkpoint_dir", "goodput.identity"
LAUNCH_TAG, ERROR_TAG, LEFT_TAG = "goodput.launch", "error", "goodput.left_running"
CHANGED = "changed."  # changed.<launch>.<key>: a key's new value from that launch on (params are immutable)


def one_line(e: BaseException | str) -> str:
    """An error as one line for the `error` tag: the type and the message, whitespace collapsed."""
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return " ".join(str(text).split())[:1000]


def _param_items(params: dict) -> dict[str, str]:
    return {k[:250]: str(v)[:6000] for k, v in params.items()}


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        _retry(client.log_batch, run_id, params=items[i : i + 100])


def start_run(
    uri: str,
    experiment: str,
    run_name: str,
    params: dict,
    run_id: str | None,
    artifact_location: str | None = None,
    tags: dict[str, str] | None = None,
) -> str:
    """Create the job's run (or continue `run_id`: see continue_run). Called once, before any worker
    starts. A run whose params cannot be logged is ended FAILED (with the error) before raising."""
    from mlflow.tracking import MlflowClient

    ensure_store(uri)
    client = MlflowClient(uri)
    if run_id is not None:
        try:
            run = _retry(client.get_run, run_id)
        except Exception:
            log.warning("MLflow run %s from the checkpoint is not in %s: starting a new run", run_id, uri)
        else:
            continue_run(client, run, params, tags or {})
            return run_id
    exp_id = get_or_create_experiment(client, experiment, artifact_location)
    run = _retry(client.create_run, exp_id, run_name=run_name, tags={**(tags or {}), LAUNCH_TAG: "1"})
    try:
        _log_params(client, run.info.run_id, _param_items(params))
    except BaseException as e:
        end_run(uri, run.info.run_id, e)
        raise
    return run.info.run_id


def log_json(uri: str, run_id: str, obj: dict | str, name: str, timeout_s: float) -> None:
    """A small artifact of the run (its identity.json; a str: as text, the code's diff), on a daemon
    thread for at most `timeout_s` (mlflow.artifact_timeout_s): an artifact store that fails or
    hangs only warns, before training as at its end."""
    from mlflow.tracking import MlflowClient

    def upload():
        try:
            client = MlflowClient(uri)
            _retry(client.log_text if isinstance(obj, str) else client.log_dict, run_id, obj, name)
        except Exception as e:
            log.warning("MLflow: could not log %s (%s)", name, e)

    th = threading.Thread(target=upload, name=f"mlflow: logging {name}", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        log.warning(
            "MLflow: logging %s took over %.0f s (mlflow.artifact_timeout_s): gave up", name, timeout_s
        )


def effective_params(params: dict[str, str]) -> dict[str, str]:
    """A run's params as its last launch set them: the first launch's, then each `changed.<n>.<key>`."""
    out = {k: v for k, v in params.items() if not k.startswith(CHANGED)}
    changes = []
    for k, v in params.items():
        n, _, key = k[len(CHANGED) :].partition(".")
        if k.startswith(CHANGED) and n.isascii() and n.isdigit() and key:
            changes.append((int(n), key, v))
    for _, key, v in sorted(changes):
        out[key] = v
    return out


def continue_run(client: MlflowClient, run, params: dict, tags: dict[str, str]) -> None:
    """A relaunch continues `run`: RUNNING again, and each param whose value differs from what the
    run has recorded becomes `changed.<launch>.<key>` (MLflow refuses to change a param), with a
    tag `changed.<launch>` listing them; keys the run never had are logged as plain params."""
    run_id = run.info.run_id
    launch = int(t) + 1 if (t := run.data.tags.get(LAUNCH_TAG, "1")).isascii() and t.isdigit() else 2
    old, new = effective_params(run.data.params), _param_items(params)
    changed = {k: v for k, v in new.items() if k in old and old[k] != v}
    added = {k: v for k, v in new.items() if k not in old and k not in run.data.params}
    _log_params(client, run_id, {**added, **{f"{CHANGED}{launch}.{k}"[:250]: v for k, v in changed.items()}})
    summary = {f"{CHANGED}{launch}": "; ".join(f"{k}: {old[k]} -> {v}" for k, v in sorted(changed.items()))}
    for k, v in {**tags, LAUNCH_TAG: str(launch), "resumed": "true", **(summary if changed else {})}.items():
        _retry(client.set_tag, run_id, k, str(v)[:5000])
    reopen(client, run_id)
    if changed:
        log.info("MLflow run %s: changed since its last launch: %s", run_id, summary[f"{CHANGED}{launch}"])


def reopen(client: MlflowClient, run_id: str) -> None:
    """The run is running again (a relaunch, an elastic restart): RUNNING, without the last error."""
    run = _retry(client.get_run, run_id)
    if ERROR_TAG in run.data.tags:
        _retry(client.delete_tag, run_id, ERROR_TAG)
    if run.info.status != "RUNNING":
        _retry(client.update_run, run_id, "RUNNING")


def end_run(uri: str, run_id: str | None, error: BaseException | str, status: str | None = None) -> None:
    """End a run that did not finish, if nobody has: status FAILED (KILLED for an interrupt, or
    `status`) with `error` as a one-line tag. A run someone already ended (a worker, which knows
    the error best) is left as it is. Never raises: it runs on the way out of a failure."""
    from mlflow.tracking import MlflowClient

    if run_id is None:
        return
    if status is None:
        status = "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED"
    try:
        client = MlflowClient(uri)
        if _retry(client.get_run, run_id).info.status == "RUNNING":
            _retry(client.set_tag, run_id, ERROR_TAG, one_line(error))
            _retry(client.set_terminated, run_id, status)
    except Exception as e:
        log.warning("could not end MLflow run %s as %s (%s)", run_id, status, e)


def run_status(uri: str, run_id: str | None) -> str | None:
    """The status of MLflow run `run_id` (FINISHED, KILLED, FAILED, RUNNING), or None when there is
    no such run or the store does not answer. Never raises."""
    from mlflow.tracking import MlflowClient

    if run_id is None:
        return None
    try:
        ensure_store(uri)
        return _retry(MlflowClient(uri).get_run, run_id).info.status
    except Exception as e:
        log.warning("could not read the status of MLflow run %s (%s)", run_id, e)
        return None


def close_leftovers(uri: str, experiment: str, checkpoint_dir: str) -> list[str]:
    """Runs of `checkpoint_dir` (their CHECKPOINT_TAG) still RUNNING: each was left so by a job that
    died without ending it (a SIGKILL, a lost node), so it is set KILLED with an `error` tag saying
    so. Only a job holding the run lock of `checkpoint_dir` may call this: no live job owns such a
    run then (the runs of other checkpoint dirs, a concurrent sweep's, are never touched). Returns
    the ids closed."""
    from mlflow.tracking import MlflowClient

    ensure_store(uri)  # before any client: one opened on a missing store would create it in place
    client = MlflowClient(uri)
    exp = _retry(client.get_experiment_by_name, experiment)
    if exp is None:
        return []
    found = _retry(client.search_runs, [exp.experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
    closed = []
    for run in found:
        if run.data.tags.get(CHECKPOINT_TAG) == checkpoint_dir:
            why = (f"left RUNNING by a job that ended without closing it (killed?); closed at "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')} by the relaunch holding the run lock")  # fmt: skip
            left = run.data.tags.get(LEFT_TAG, "0")  # kept when a relaunch continues the run
            _retry(client.set_tag, run.info.run_id, LEFT_TAG, str(int(left) + 1 if left.isdigit() else 1))
            _retry(client.set_tag, run.info.run_id, ERROR_TAG, why)
            _retry(client.set_terminated, run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
    if closed:
        log.warning("MLflow: closed %d run(s) of %s left RUNNING by a killed job: %s", len(closed),
                    checkpoint_dir, ", ".join(closed))  # fmt: skip
    return closed


def system_monitor(uri: str, run_id: str, interval_s: float):
    """MLflow's own system metrics monitor, continuing the run's system/* steps after a restart
    (resume_logging), or None where it cannot start (it must never stop training)."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        m = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=uri)
        m.start()
        return m
    except Exception as e:
        log.warning("MLflow system metrics are off: %s", e)
        return None


class Tracker:
    """Rank 0's MLflow writer. Everything it sends goes through one queue, written in order by a
    daemon thread, which is also where the client is opened (a second or so for a SQLite store) and
    the run set RUNNING again: a restart's first step never waits for the tracking store."""

    def __init__(
        self,
        uri: str | None,
        run_id: str | None,
        enabled: bool,
        system_metrics_interval_s: float | None = None,
    ):
        self.enabled = enabled and uri is not None and run_id is not None
        self.run_id = run_id
        self._system = None
        if not self.enabled:
            return
        self._client = None
        self._opened = threading.Event()
        self._q: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        args = (uri, system_metrics_interval_s)
        self._thread = threading.Thread(target=self._drain, args=args, name="mlflow-log", daemon=True)
        self._thread.start()

    @property
    def client(self) -> MlflowClient | None:
        """The open client (None if the store could not be opened); waits for the writer to open it."""
        self._opened.wait()
        return self._client

    def _open(self, uri: str, system_metrics_interval_s: float | None) -> None:
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(uri)
            # a restarted worker's run was closed FAILED by the last one (and MLflow's system
            # monitor stops at once on a run that is not RUNNING): it is running again
            reopen(client, self.run_id)
            self._client = client
        except Exception as e:
            log.warning("MLflow store %s could not be opened (%s): this run logs nothing; training goes on",
                        uri, e)  # fmt: skip
        finally:
            self._opened.set()
        if self._client is not None and system_metrics_interval_s:
            self._system = system_monitor(uri, self.run_id, system_metrics_interval_s)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            from mlflow.entities import Metric

            ts = int(time.time() * 1000)
            for k, v in metrics.items():
                self._q.put(Metric(k, float(v), ts, step))

    def _drain(self, uri: str, system_metrics_interval_s: float | None) -> None:
        self._open(uri, system_metrics_interval_s)
        while True:
            got = [self._q.get()]
            self._closing.wait(0.5)  # let a batch gather (not when closing: a failed rank exits fast)
            while not self._q.empty() and len(got) < 900:
                got.append(self._q.get_nowait())
            batch = []
            for item in got:  # in order: a call queued after some metrics is made after their write
                if item is None or callable(item):
                    self._write(batch)
                    batch = []
                    if item is not None:
                        self._call(item)
                else:
                    batch.append(item)
            self._write(batch)
            for _ in got:
                self._q.task_done()
            if any(item is None for item in got):  # the sentinel: close() was called
                return

    def _write(self, metrics: list) -> None:
        if metrics and self._client is not None:
            try:
                _retry(self._client.log_batch, self.run_id, metrics=metrics)
            except Exception as e:
                log.warning("MLflow logging failed (%s); training goes on", e)

    def _call(self, fn) -> None:
        if self._client is not None:
            try:
                fn(self._client)
            except Exception as e:
                log.warning("MLflow: %s (training goes on)", e)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queued, like the metrics: written in order, after what was logged before."""
        if self.enabled:
            tags = {k: str(v) for k, v in tags.items()}

            def write(client):
                for k, v in tags.items():
                    _retry(client.set_tag, self.run_id, k, v)

            self._q.put(write)

    def artifact(self, path: str, subdir: str | None = None) -> None:
        if self.enabled and (client := self.client) is not None:
            try:
                _retry(client.log_artifact, self.run_id, path, subdir)
            except Exception as e:
                log.warning("could not log artifact %s: %s", path, e)

    def artifacts(self, path: str, subdir: str | None = None) -> None:
        if self.enabled and (client := self.client) is not None:
            try:
                _retry(client.log_artifacts, self.run_id, path, subdir)
            except Exception as e:
                log.warning("could not log artifacts %s: %s", path, e)

    def log_dataset(self, root: str, digest: str, context: str = "train") -> None:
        """Fill the run's Dataset column: the data root, named by its last folder, with a digest of
        its file list (a changed listing shows as another dataset). Queued, like the metrics."""
        if not self.enabled:
            return

        def write(client):
            from mlflow.data.dataset_source_registry import resolve_dataset_source
            from mlflow.data.meta_dataset import MetaDataset
            from mlflow.entities import DatasetInput, InputTag

            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the registry warns about its own future
                    source = resolve_dataset_source(root)
                ds = MetaDataset(source, name=root.rstrip("/").rsplit("/", 1)[-1] or root, digest=digest)
                entry = DatasetInput(ds._to_mlflow_entity(), [InputTag("mlflow.data.context", context)])
                _retry(client.log_inputs, self.run_id, datasets=[entry])
            except Exception as e:  # e.g. a protocol MLflow has no dataset source for (memory://)
                log.warning("MLflow: could not record the dataset %s (%s)", root, e)

        self._q.put(write)

    def close(self, status: str = "FINISHED", error: BaseException | None = None) -> None:
        """End the run: FINISHED, KILLED (interrupted, preempted) or FAILED, with `error` as a tag."""
        if self.enabled:
            self.enabled = False
            self._closing.set()
            self._q.put(None)
            self._thread.join(timeout=60)  # what was queued is written (and the client open)
            if self._system is not None:  # its last samples, written before the run ends; bounded,
                done = threading.Thread(target=self._system.finish, daemon=True)  # as the queue is
                done.start()
                done.join(timeout=30)
                self._system = None
            client = self._client if self._opened.is_set() else None
            if client is None:
                return
            if error is not None:
                _retry(client.set_tag, self.run_id, ERROR_TAG, one_line(error))
            _retry(client.set_terminated, self.run_id, status)
