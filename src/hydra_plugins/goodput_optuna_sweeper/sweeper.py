"""The sweeper (see the package docstring). Hydra finds it by scanning the hydra_plugins namespace;
optuna and MLflow are imported only when a search starts (_study, _runs)."""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import CompactHydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("hydra_plugins.goodput_optuna_sweeper")

OBJECTIVE = re.compile(r"^val/.+$")  # summary.json's `val` keys; which ones: the task's (objective_error)


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        metric: str,
        direction: str = "maximize",
        n_trials: int = 20,
        n_jobs: int = 1,
        sampler: Any = None,
        study_name: str | None = None,
        storage: str | None = None,
        params: dict | None = None,
    ):
        """`sampler`: built again in sweep() from hydra.sweeper.sampler, seeded for the study's size."""
        if direction not in ("maximize", "minimize"):
            raise ValueError(f"hydra.sweeper.direction must be maximize|minimize, got {direction!r}")
        if not (isinstance(metric, str) and OBJECTIVE.match(metric)):
            # each trial returns summary.json's `val` entry of this name: another name is no objective
            raise ValueError(
                f"hydra.sweeper.metric must be a metric the final evaluation logs (val/loss, "
                f"val/accuracy, ... : the task's), got {metric!r}"
            )
        if n_trials < 1 or n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_trials and n_jobs must be >= 1, got {n_trials}, {n_jobs}")
        self.metric, self.direction, self.n_trials, self.n_jobs = metric, direction, n_trials, n_jobs
        self.study_name, self.storage = study_name, storage
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.config: DictConfig | None = None
        self.launcher = None
        self.job_idx = 0
        self.lock = None  # the search's lock (goodput.resilience.lock), once taken

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _space(self, arguments: list[str]) -> tuple[dict, list[str]]:
        """The search space (the preset's params, then the command line's sweeps) and the fixed overrides."""
        from hydra_plugins.goodput_optuna_sweeper._study import distribution

        parser = OverridesParser.create()
        space, fixed = {}, []
        preset = parser.parse_overrides([f"{k}={v}" for k, v in self.params.items()])
        for o in preset + parser.parse_overrides(arguments):
            d = distribution(o)
            if d is None:
                fixed.append(o.input_line)
            else:
                space[o.get_key_element()] = d
        if not space:
            raise ValueError("hparams search: nothing to search (hydra.sweeper.params is empty)")
        return space, fixed

    def sweep(self, arguments: list[str]) -> Any:
        from goodput.errors import UserError
        from goodput.resilience.lock import RunLocked

        try:
            return self._sweep(arguments)
        except (UserError, RunLocked) as e:  # a refusal: one line and exit 2, as scripts/train.py's
            log.error("%s", e)
            sys.exit(2)

    def _sweep(self, arguments: list[str]) -> dict:
        from hydra_plugins.goodput_optuna_sweeper import _study
        from hydra_plugins.goodput_optuna_sweeper._runs import ParentRun

        assert self.config is not None and self.launcher is not None
        c = self.config
        wrong = objective_error(self.metric, c.task)
        if wrong:
            from goodput.config import ConfigError

            raise ConfigError(wrong)
        space, fixed = self._space(arguments)
        d = _study.definition(space, fixed, self.metric, self.direction, c.run.name)
        name = self.study_name or _study.default_name(d)
        storage = _study.storage_url(self.storage)
        lock = self._lock(name)
        try:
            study = _study.open_study(name, storage, self.direction, d, explicit=self.study_name is not None)
            _study.recover(study)
            study.sampler = _study.sampler(c.hydra.sweeper.get("sampler"), len(study.trials)) or study.sampler
            settings = {"metric": self.metric, "direction": self.direction}
            parent = ParentRun(
                c, name, {"search": d["space"], "sweeper": settings}, study.user_attrs.get(_study.PARENT_RUN)
            )
            if parent.run_id:
                study.set_user_attr(_study.PARENT_RUN, parent.run_id)
            try:
                stopped = self._run(study, space, fixed, parent, name)
            except BaseException:
                parent.finish({}, "KILLED")
                raise
            best = self._best(study, name)
            parent.finish(best, "KILLED" if stopped else "FINISHED")
        finally:
            lock.release()
        os.makedirs(c.hydra.sweep.dir, exist_ok=True)  # (no job ran when the study was complete already)
        out = f"{c.hydra.sweep.dir}/optimization_results.yaml"
        OmegaConf.save(OmegaConf.create(best), out)
        log.info("hparams search: %s (%s)", best, out)
        return best

    def _lock(self, name: str):
        """One process per search, by the rule of a run's lock (goodput.resilience.lock): a relaunch
        while it runs is refused, a dead one's lock is taken over, so the RUNNING trials the study
        then holds are leftovers of a killed search. The lock sits above the trials' checkpoints."""
        from hydra.utils import instantiate

        from goodput.resilience.lock import RunLock

        c = self.config
        root = str(c.paths.checkpoint_dir)
        root = root if "://" in root else os.path.abspath(root)
        lock = RunLock(instantiate(c.storage)(f"{root}/{name}"), c.run.lock_stale_seconds)
        lock.acquire()
        self.lock = lock
        return lock

    def _run(self, study, space: dict, fixed: list[str], parent, name: str) -> bool:
        """Ask, launch, tell until n_trials trials count. True when a trial was stopped (a signal):
        the search stops too, and relaunching the command continues it."""
        from hydra_plugins.goodput_optuna_sweeper import _study

        done = len(_study.counted(study))
        if done:
            log.info("hparams search: study %s continues: %d of %d trials done", name, done, self.n_trials)
        while done < self.n_trials:
            if self.lock is not None:  # another search took it over: it asks and tells now (LockLost)
                self.lock.check()
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            for t in trials:  # each trial its own checkpoints and MLflow run; a resumed one its old run's
                if t.user_attrs.get(_study.RUN_NAME) is None:
                    t.set_user_attr(_study.RUN_NAME, f"{name}/trial-{t.number:03d}")
            plumbing = [f"mlflow.parent_run_id={parent.run_id or 'null'}"]
            batch = [
                tuple(fixed + [_override(k, t.params[k]) for k in space] + plumbing
                      + [_override("run.name", t.user_attrs[_study.RUN_NAME])])
                for t in trials
            ]  # fmt: skip
            self.validate_batch_is_legal(batch)
            try:
                returns = self.launcher.launch(batch, initial_job_idx=self.job_idx)
            except BaseException:  # a second Ctrl-C, a launcher's error: these trials did not finish
                for t in trials:
                    _study.interrupt(study, t, "was running when the search stopped")
                raise
            self.job_idx += len(returns)
            stopped = [self._tell(study, t, r, parent) for t, r in zip(trials, returns)]
            done = len(_study.counted(study))
            if any(stopped):
                log.warning(
                    "hparams search %s stopped: %d of %d trials done; the same command continues it",
                    name, done, self.n_trials,
                )  # fmt: skip
                return True
        return False

    def _tell(self, study, t, r, parent) -> bool:
        """A job's result as its trial's; True when the job was stopped before it finished."""
        from optuna.trial import TrialState

        from hydra_plugins.goodput_optuna_sweeper import _study

        state, value, why, summary = outcome(r, self.metric)
        if state == "interrupted":
            _study.interrupt(study, t, why)
            return True
        if state == "complete":
            study.tell(t, value)
        else:
            t.set_user_attr(_study.ERROR, why)
            study.tell(t, state=TrialState.FAIL)
            log.warning("hparams search: trial %d failed: %s", t.number, why)
            parent.failed(t.number, t.user_attrs[_study.RUN_NAME], dict(t.params), why)
        parent.trial(t.number, value, summary)
        return False

    def _best(self, study, name: str) -> dict:
        from optuna.trial import TrialState

        from hydra_plugins.goodput_optuna_sweeper._study import counted

        trials = counted(study)
        ok = [t for t in trials if t.state == TrialState.COMPLETE]
        best = {
            "name": "optuna",
            "study": name,
            "metric": self.metric,
            "direction": self.direction,
            "trials": len(trials),
            "complete": len(ok),
        }
        if ok:
            best.update(
                best_value=study.best_value, best_params=study.best_params, best_trial=study.best_trial.number
            )
        return best


def _override(key: str, value) -> str:
    return f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"


def outcome(r, metric: str) -> tuple[str, float | None, str | None, dict | None]:
    """A job's result as a trial's: (state, value, why, summary), state "complete", "failed" or
    "interrupted". scripts/train.py returns the run's summary; a refusal or a crash is the job's
    exception, which Hydra keeps (return_value raises it again)."""
    try:
        summary = r.return_value
    except CompactHydraException as e:  # scripts/train.py's refusal: its message says it all
        return "failed", None, " ".join(str(e).split())[:2000], None
    except Exception as e:
        return "failed", None, " ".join(f"{type(e).__name__}: {e}".split())[:2000], None
    if not isinstance(summary, dict):
        return "failed", None, "the job returned no summary (was its run already complete?)", None
    steps, stopped_by = summary.get("steps", 0), summary.get("preempted")
    if stopped_by and steps < r.cfg.trainer.max_steps and not summary.get("stop_reason"):
        return "interrupted", None, f"was stopped by {stopped_by} at step {steps}", summary
    v = (summary.get("val") or {}).get(metric)
    if v is None or isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
        return "failed", None, f"its summary has no {metric}", summary
    return "complete", float(v), None, summary


def objective_error(metric: str, task_node) -> str | None:
    """Why `metric` is no objective for the task `task_node` builds (None: it is one): each trial
    returns summary.json's `val` entry of this name, which has the task's metrics (goodput.recipe.task
    metric_modes) and a `val/class/<name>` per class."""
    from hydra.utils import instantiate

    modes = instantiate(task_node).metric_modes(None)
    if metric in modes or metric.startswith("val/class/"):
        return None
    return (
        f"hydra.sweeper.metric={metric} is not a metric the final evaluation logs: task "
        f"{task_node['_target_']} logs {', '.join(modes)} and val/class/<name>"
    )
