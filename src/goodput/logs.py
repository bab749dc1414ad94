"""One log format for everything a run prints: Hydra's job logging (conf/hydra/default.yaml names
`Formatter`), every rank's worker (`setup`), MLflow's loggers, torch's elastic agent and Python
warnings all reach the root logger's handlers and print as

    2026-12-02 01:05:52,326 INFO rank0 goodput.checkpoint.manager: checkpoint step 4 committed in 0.15s

`job` instead of `rank<N>` is the job process (before it runs a rank, or the elastic agent's). The
run dir's `train.log` gets the same lines: Hydra's file handler in the job process, and rank 0 of
the elastic agent's workers appends to it (their lines would reach only the console)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

FORMAT = "%(asctime)s %(levelname)s %(who)s %(name)s: %(message)s"
FILE = "train.log"  # in the run dir: the name conf/hydra/default.yaml gives Hydra's file handler
_who = f"rank{os.environ['RANK']}" if "RANK" in os.environ else "job"  # torchrun/srun: a rank from the start

# MLflow gives these loggers a handler of its own (its format) and stops them propagating.
MLFLOW_LOGGERS = ("mlflow", "sqlalchemy.engine", "alembic", "huey")
# Status chatter at INFO on every run that asks nothing of the user ("Skip logging GPU metrics. Set
# logger level to DEBUG for more details." on CPU, "Started/Stopping monitoring system metrics"), and
# alembic's line per schema migration when a store is created (about 60; MLflow quiets them itself
# only when it configures logging, which setup turns off).
# (MLflow's "Creating initial MLflow database tables..." stays: once per store, it explains a pause.)
QUIET = ("mlflow.system_metrics", "alembic")


class Formatter(logging.Formatter):
    """FORMAT, with the process's rank (`job` before it has one)."""

    def __init__(self):
        super().__init__(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.who = _who
        return super().format(record)


def setup(rank: int | str | None = None, run_dir: str | None = None) -> None:
    """This process prints in FORMAT: the root logger's handlers (Hydra's console and file handlers in
    the job process; a stderr handler in an elastic worker, which has none) get Formatter, MLflow's
    loggers propagate to them, and warnings are logged as one line each. `rank`: from now on lines
    say `rank<N>`; rank 0 of an elastic worker group also appends to `<run_dir>/train.log` (unless
    a handler of this process writes it already: Hydra's, under torchrun). Idempotent."""
    global _who
    if rank is not None:  # (a str: the process's own name, as a spare's `spare<n>`)
        _who = rank if isinstance(rank, str) else f"rank{rank}"
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    path = os.path.abspath(os.path.join(run_dir, FILE)) if run_dir else None
    elastic = rank == 0 and "TORCHELASTIC_RUN_ID" in os.environ
    if elastic and path and path not in {getattr(h, "baseFilename", None) for h in root.handlers}:
        root.addHandler(logging.FileHandler(path))  # appends, as Hydra's does
    for h in root.handlers:
        h.setFormatter(Formatter())
    root.setLevel(logging.INFO)
    # MLflow configures its loggers when it is imported; it is imported lazily (after this, when the
    # job opens its store): ask it not to. One imported already is put right by hand.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    for name in MLFLOW_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [], True
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.showwarning = _log_warning


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one log line (Python's own print adds the source line below it)."""
    logging.getLogger("py.warnings").warning("%s: %s (%s:%s)", category.__name__, message, filename, lineno)


@contextlib.contextmanager
def known_warning(message: str, module: str, category: type[Warning] = UserWarning):
    """Around one call that is known to warn harmlessly: that warning (its message's start, from
    `module`) is not shown; any other still is. The caller says why it is harmless. (The filter is
    process-wide while the block runs: another thread's identical warning is hidden too.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
        yield


@contextlib.contextmanager
def known_log_line(logger: str, message: str):
    """`known_warning` for a library that warns through `logging`: records of `logger` whose message
    starts with `message` are dropped while the block runs; the caller says why they are harmless."""

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(message)

    target = logging.getLogger(logger)
    target.addFilter(keep)
    try:
        yield
    finally:
        target.removeFilter(keep)
