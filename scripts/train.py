"""Hydra entry point: `python scripts/train.py [group=option ...] [key=value ...]`, or `-m` to sweep.

Composes the config once, checks it, creates demo data and the MLflow run, then launches the
workers (see goodput.run.launch). Relaunching the same command resumes from the newest commit.
"""

import atexit
import gc
import logging
import os
import shlex
import sys
from pathlib import Path

from goodput.resilience.signals import HELPER_ENV, obey_parent_only

if __name__ == "__mp_main__" and os.environ.get(HELPER_ENV):  # a helper the loop spawned: first thing
    obey_parent_only()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.errors import CompactHydraException  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from goodput import logs, targets  # noqa: E402
from goodput.errors import UserError  # noqa: E402
from goodput.resilience.lock import RunLocked  # noqa: E402
from goodput.run.progress import done_line  # noqa: E402

log = logging.getLogger("goodput")
CONF = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF, config_name="train")
def main(cfg: DictConfig) -> dict | None:
    """Returns the run's summary (the Optuna sweeper reads its objective, hydra.sweeper.metric, there)."""
    # Here, not at the top: `--help` and `--cfg` compose the config without importing torch or mlflow.
    from goodput.run.job import AlreadyDone, close_failed, prepare
    from goodput.run.launch import RendezvousUnreachable, launch

    logs.setup()  # goodput.logs: MLflow's lines and warnings in the format of Hydra's (conf/hydra)
    hc = HydraConfig.get()
    sweep, suffix = hc.mode == RunMode.MULTIRUN, None
    if sweep:
        suffix = hc.job.override_dirname.replace("/", "_") or str(hc.job.num)
    try:
        targets.check(cfg, hc.overrides.task, dict(hc.runtime.choices))  # a swapped _target_'s old keys
        c, ctx, lock = prepare(cfg, hc.runtime.output_dir, suffix, dict(hc.runtime.choices), CONF)
    except AlreadyDone as e:
        log.info("%s", e)
        return
    except (UserError, FileNotFoundError, FileExistsError, RunLocked) as e:
        refuse(e, sweep)
    try:
        summary = launch(c, ctx)
    except BaseException as e:
        close_failed(c, ctx, e)  # the MLflow run ends FAILED (KILLED: interrupted), the error as a tag
        if isinstance(e, RendezvousUnreachable | UserError):  # a data or store refusal: one line, exit 2
            refuse(e, sweep)
        raise
    finally:
        if lock is not None:
            lock.release()
    if summary is None:
        return None
    log.info("summary: %s", os.path.join(ctx.run_dir, "summary.json"))
    log.info("MLflow: %s (run %s) - `make mlflow-ui` opens it", c.mlflow.tracking_uri, ctx.mlflow_run_id)
    if not summary["finished"]:  # stopped by a signal: the last line says where, and how to go on
        log.warning(
            "stopped by %s at step %d of %d (not finished; newest checkpoint: step %s). To continue, "
            "run the same command again: python %s",
            summary["preempted"], summary["steps"], c.trainer.max_steps, summary["last_committed_step"],
            shlex.join(sys.argv),
        )  # fmt: skip
        return summary  # the Optuna sweeper reads `preempted` from it
    log.info("%s", done_line(summary))
    return summary


class JobRefused(CompactHydraException):
    """A refusal in a sweep's job: Hydra prints its message alone, no traceback."""


def refuse(e: Exception, sweep: bool):
    """A refusal the user must fix: one line, exit 2. In a sweep (-m, a search) it raises instead:
    a SystemExit would escape Hydra's job runner and end the whole sweep, an exception fails this
    job only. The Optuna sweeper records a failed trial and goes on; the basic sweeper runs the
    other jobs, then exits 1 with this line (Hydra's rule for a failed job)."""
    log.error("%s", e)
    if sweep:
        job = HydraConfig.get().job
        raise JobRefused(f"job {job.num} ({job.override_dirname}): {e}") from e
    sys.exit(2)


if __name__ == "__main__":
    # Exit without the collector's passes over torch's, MLflow's and sympy's objects while the
    # interpreter tears its modules down: an exit with these imports took 1.4 s, and 0.2 s after
    # gc.freeze() (docs/testing.md). At exit, not in a finally: run in-process (runpy, a notebook,
    # a test) main() returns to a caller whose collector must keep working. Handlers registered
    # later run before this one, refcounted finalizers still run, and the OS frees the rest.
    atexit.register(gc.freeze)
    main()
