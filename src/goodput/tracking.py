"""MLflow: one run per job, continued across restarts (its id lives in the checkpoint).

Metrics, tags and the dataset are queued and written in order by a background thread (metrics in
batches), which also opens the store: logging never stalls the loop (and never inflates
fetch_seconds), and a restart never waits for MLflow; `close()` flushes. Files go to the artifact
store on a second thread, so a slow upload never holds the metrics back. Only rank 0 tracks.

No MLflow call of a job waits without a bound of the template's own (MLflow's HTTP client waits
120 s on each of 8 tries): the calls before the first step together for mlflow.start_timeout_s
(`within`), each upload for mlflow.artifact_timeout_s, and the end of the run (the logged model, the
files, the last metrics, the run's state) together for mlflow.end_timeout_s (`Tracker.close`).

Why not MLflow's own asynchronous logging (`log_batch(synchronous=False)`,
MLFLOW_ENABLE_ASYNC_LOGGING): its call also returns without touching the store, but
- a write that fails is logged and dropped: no retry, and the logging function is bound when the
  store is created, so none can be added (a SQLite file locked past MLflow's busy timeout, as
  parallel sweep jobs do, loses metrics; this queue's `_retry` does not);
- by default every call is its own write, on up to 10 writer threads; merging needs
  MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS, a process-wide environment variable;
- its flush and its atexit hook wait without a bound: a store that never answers keeps the process
  from exiting (here the threads are daemons, and close() waits at most mlflow.end_timeout_s);
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
from functools import partial
from typing import TYPE_CHECKING

from goodput.errors import UserError
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
    """Bound on each upload to the artifact store (identity.json, a profiler trace, the logged model,
    each of the run's files), made on a thread of its own: one slower than that is given up with a
    warning and the next goes on. Training never waits for an upload; the end of the run waits for
    them all together at most mlflow.end_timeout_s."""

    start_timeout_s: float = 120.0
    """Bound on the MLflow calls before the first step, together: closing the runs a killed job left
    RUNNING, reading the run's status, creating or continuing the run. A tracking store that has not
    answered by then ends the launch with one line, exit 2, before anything is trained (MLflow's own
    HTTP client waits 120 s on each of 8 tries)."""

    end_timeout_s: float = 120.0
    """Bound on the end of the run, after its final commit, all together: the logged model, the run's
    files (summary.json, goodput.png, the evaluation report, .hydra/), the last metrics and the MLflow
    run's state. Past it: a warning naming what was not logged, and exit 0 (the run is complete: the
    checkpoint holds the model, summary.json is written); the MLflow run is not FINISHED, and the
    next launch of the same command logs the run's end and ends it FINISHED. It bounds the end of a
    stopped or failed run too. An upload that fails (rather than hangs) only warns, as before."""

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
        for key in ("artifact_timeout_s", "start_timeout_s", "end_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"mlflow.{key} must be > 0, got {getattr(self, key)}")
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


class StoreTimeout(UserError, TimeoutError):
    """The tracking store did not answer the calls before the first step within mlflow.start_timeout_s."""


def within(fn, timeout_s: float, what: str):
    """`fn()` on a daemon thread for at most `timeout_s`: its result, or the exception it raised;
    TimeoutError past the bound. The thread is left to end (or hang) on its own: a store that does
    not answer holds that thread, never the caller."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    th = threading.Thread(target=call, name=f"mlflow: {what}", daemon=True)
    th.start()
    th.join(max(0.0, timeout_s))
    if th.is_alive():
        raise TimeoutError(f"{what}: no answer within {timeout_s:.3g} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


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


def end_run(
    uri: str,
    run_id: str | None,
    error: BaseException | str,
    status: str | None = None,
    timeout_s: float = 120.0,
) -> None:
    """End a run that did not finish, if nobody has: status FAILED (KILLED for an interrupt, or
    `status`) with `error` as a one-line tag. A run someone already ended (a worker, which knows
    the error best) is left as it is. Never raises, and waits at most `timeout_s`
    (mlflow.end_timeout_s): it runs on the way out of a failure. A run left RUNNING is closed by
    the next launch (close_leftovers)."""
    from mlflow.tracking import MlflowClient

    if run_id is None:
        return
    if status is None:
        status = "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED"

    def end():
        client = MlflowClient(uri)
        if _retry(client.get_run, run_id).info.status == "RUNNING":
            _retry(client.set_tag, run_id, ERROR_TAG, one_line(error))
            _retry(client.set_terminated, run_id, status)

    try:
        within(end, timeout_s, f"ending MLflow run {run_id}")
    except Exception as e:
        log.warning("could not end MLflow run %s as %s (%s)", run_id, status, e)


def run_status(uri: str, run_id: str | None, timeout_s: float = 120.0) -> str | None:
    """The status of MLflow run `run_id` (FINISHED, KILLED, FAILED, RUNNING), or None when there is
    no such run or the store does not answer within `timeout_s`. Never raises."""
    from mlflow.tracking import MlflowClient

    if run_id is None:
        return None

    def status():
        ensure_store(uri)
        return _retry(MlflowClient(uri).get_run, run_id).info.status

    try:
        return within(status, timeout_s, f"reading the status of MLflow run {run_id}")
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


# The share of mlflow.end_timeout_s kept for the MLflow run's state (two calls): the uploads and the
# queued metrics get the rest, so a hung artifact store still leaves time to end the run (KILLED,
# naming what is missing) within the bound.
STATE_SHARE_S = 10.0


class Tracker:
    """Rank 0's MLflow writer. Metrics, tags and the dataset go through one queue, written in order
    by a daemon thread, which is also where the client is opened (a second or so for a SQLite store)
    and the run set RUNNING again: a restart's first step never waits for the tracking store. Files
    go through a second queue, uploaded in order by another daemon thread, each for at most
    `artifact_timeout_s`: a hung artifact store never holds the metrics back, nor the loop.
    `close` ends the run within `end_timeout_s` (counted from `end_starts`, when the run's end
    begins) and returns what it could not log by then."""

    def __init__(
        self,
        uri: str | None,
        run_id: str | None,
        enabled: bool,
        system_metrics_interval_s: float | None = None,
        end_timeout_s: float = 120.0,
        artifact_timeout_s: float = 600.0,
    ):
        self.enabled = enabled and uri is not None and run_id is not None
        self.run_id = run_id
        self.end_timeout_s, self.artifact_timeout_s = end_timeout_s, artifact_timeout_s
        self.missed: list[str] = []  # what was not logged within its bound, by name
        self._end_by: float | None = None
        self._system = None
        if not self.enabled:
            return
        self._client = None
        self._opened = threading.Event()
        self._q: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._uploads: queue.Queue = queue.Queue()
        self._pending: list[str] = []  # queued uploads not done yet, by name
        self._lock = threading.Lock()
        args = (uri, system_metrics_interval_s)
        self._thread = threading.Thread(target=self._drain, args=args, name="mlflow-log", daemon=True)
        self._thread.start()
        self._uploader = threading.Thread(target=self._upload, name="mlflow-upload", daemon=True)
        self._uploader.start()

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

    def _upload(self) -> None:
        """The upload thread: each queued file in turn, each for at most artifact_timeout_s (on a
        thread of its own: one the store never answers is given up, and the next goes on)."""
        while (item := self._uploads.get()) is not None:
            name, fn = item
            self._opened.wait()
            try:
                if self._client is not None:
                    within(partial(fn, self._client), self.artifact_timeout_s, f"logging {name}")
            except TimeoutError:
                log.warning("MLflow: logging %s took over %.0f s (mlflow.artifact_timeout_s): gave up",
                            name, self.artifact_timeout_s)  # fmt: skip
                self.missed.append(name)
            except Exception as e:
                log.warning("MLflow: could not log %s (%s)", name, e)
            finally:
                with self._lock:
                    self._pending.remove(name)

    def _upload_later(self, name: str, fn) -> None:
        if self.enabled:
            with self._lock:
                self._pending.append(name)
            self._uploads.put((name, fn))

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queued, like the metrics: written in order, after what was logged before."""
        if self.enabled:
            tags = {k: str(v) for k, v in tags.items()}

            def write(client):
                for k, v in tags.items():
                    _retry(client.set_tag, self.run_id, k, v)

            self._q.put(write)

    def artifact(self, path: str, subdir: str | None = None) -> None:
        """Queued for the upload thread: returns at once."""
        name = f"{subdir}/{os.path.basename(path)}" if subdir else os.path.basename(path)
        self._upload_later(name, lambda client: _retry(client.log_artifact, self.run_id, path, subdir))

    def artifacts(self, path: str, subdir: str | None = None) -> None:
        """A folder's files, queued for the upload thread: returns at once."""
        name = f"{subdir or os.path.basename(path.rstrip('/'))}/"
        self._upload_later(name, lambda client: _retry(client.log_artifacts, self.run_id, path, subdir))

    def log_dict(self, obj: dict, name: str) -> None:
        """A small JSON file of the run (its identity.json), queued for the upload thread."""
        self._upload_later(name, lambda client: _retry(client.log_dict, self.run_id, obj, name))

    def log_text(self, text: str, name: str) -> None:
        """A small text file of the run (code.diff), queued for the upload thread."""
        self._upload_later(name, lambda client: _retry(client.log_text, self.run_id, text, name))

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

    def end_starts(self) -> None:
        """The run's end begins (its final commit is made): from now on, the model, the files, the
        last metrics and the run's state get end_timeout_s together (upload_timeout, close)."""
        self._end_by = time.monotonic() + self.end_timeout_s

    def _left(self, keep: float) -> float:
        end_by = self._end_by if self._end_by is not None else time.monotonic() + self.end_timeout_s
        return max(0.0, end_by - keep - time.monotonic())

    def _state_share(self) -> float:
        return min(STATE_SHARE_S, self.end_timeout_s / 4)

    def upload_timeout(self) -> float:
        """The bound of an upload made now (the logged model's): artifact_timeout_s, and once the
        end has begun, no later than leaves the run's state its share of end_timeout_s."""
        if self._end_by is None:
            return self.artifact_timeout_s
        return min(self.artifact_timeout_s, self._left(self._state_share()))

    def close(
        self, status: str = "FINISHED", error: BaseException | str | None = None, hint: str = ""
    ) -> list[str]:
        """End the run: FINISHED, KILLED (interrupted, preempted) or FAILED, with `error` as a tag;
        within end_timeout_s of end_starts (or of now). What was queued is written first. Returns
        what was not logged in time (empty: everything was), named in a warning (with `hint`, what
        happens next). A run meant to end FINISHED with something missing ends KILLED, its `error`
        tag naming what: a relaunch of the job writes its end again (goodput.run.job)."""
        if not self.enabled:
            return []
        self.enabled = False
        keep = self._state_share()
        if self._end_by is None:
            self.end_starts()
        self._closing.set()
        self._q.put(None)
        self._uploads.put(None)
        self._thread.join(self._left(keep))  # what was queued is written (and the client open)
        self._uploader.join(self._left(keep))
        if self._system is not None:  # its last samples, written before the run ends (bounded)
            done = threading.Thread(target=self._system.finish, daemon=True)
            done.start()
            done.join(min(30.0, self._left(keep)))
            self._system = None
        with self._lock:
            missed = [*self.missed, *self._pending]
        if self._thread.is_alive():  # the tracking store did not answer
            missed.append("the metrics and tags still queued")
        if not self._opened.is_set():
            missed.append(f"the run's state {status}")
        elif self._client is not None:  # (None: the store could not be opened, as warned)
            if missed and status == "FINISHED":
                status = "KILLED"
                bound, what = f"mlflow.end_timeout_s={self.end_timeout_s:g} s", ", ".join(missed)
                error = f"not logged within {bound}: {what}; the next launch of the same command logs them"
            client = self._client

            def terminate():
                if error is not None:
                    _retry(client.set_tag, self.run_id, ERROR_TAG, one_line(error))
                _retry(client.set_terminated, self.run_id, status)

            try:
                within(terminate, self._left(0.0), f"ending MLflow run {self.run_id}")
            except TimeoutError:
                missed.append(f"the run's state {status}")
        if missed:
            log.warning("MLflow run %s: not logged within mlflow.end_timeout_s=%g s: %s%s", self.run_id,
                        self.end_timeout_s, ", ".join(missed), f". {hint}" if hint else "")  # fmt: skip
        return missed
