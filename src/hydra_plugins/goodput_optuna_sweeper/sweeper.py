"""The sweeper (see the package docstring). Hydra finds it by scanning the hydra_plugins namespace."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

log = logging.getLogger(__name__)


def distribution(o: Override) -> BaseDistribution | None:
    """Hydra's sweep syntax as an Optuna distribution; None for a plain value (passed to every trial)."""
    v = o.value()
    if isinstance(v, ChoiceSweep):
        return CategoricalDistribution([x for x in o.sweep_iterator(transformer=lambda e: e)])
    if isinstance(v, IntervalSweep):
        log_scale = "log" in v.tags
        if isinstance(v.start, int) and isinstance(v.end, int):
            return IntDistribution(v.start, v.end, log=log_scale)
        return FloatDistribution(float(v.start), float(v.end), log=log_scale)
    if isinstance(v, RangeSweep):
        if all(isinstance(x, int) for x in (v.start, v.stop, v.step)):
            return IntDistribution(v.start, v.stop - 1, step=v.step)  # range(): stop excluded
        return CategoricalDistribution([x for x in o.sweep_iterator(transformer=lambda e: e)])
    if o.is_sweep_override():
        raise ValueError(f"{o.input_line}: not a sweep the Optuna sweeper understands")
    return None


OBJECTIVE = re.compile(r"^val/(loss|accuracy|top[1-9][0-9]*|class/.+)$")  # summary.json's `val` keys


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
        if direction not in ("maximize", "minimize"):
            raise ValueError(f"hydra.sweeper.direction must be maximize|minimize, got {direction!r}")
        if not (
            isinstance(metric, str) and re.match(r"^val/(loss|accuracy|top[1-9][0-9]*|class/.+)$", metric)
        ):
            # each trial returns summary.json's `val` entry of this name: another name is no objective
            raise ValueError(
                f"hydra.sweeper.metric must be a metric the final evaluation logs (val/loss, "
                f"val/accuracy, val/top<k>, val/class/<name>), got {metric!r}"
            )
        if n_trials < 1 or n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_trials and n_jobs must be >= 1, got {n_trials}, {n_jobs}")
        self.metric, self.direction, self.n_trials, self.n_jobs = metric, direction, n_trials, n_jobs
        self.sampler_cfg, self.study_name, self.storage = sampler, study_name, storage
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.config: DictConfig | None = None
        self.launcher = None
        self.job_idx = 0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def _space(self, arguments: list[str]) -> tuple[dict[str, BaseDistribution], list[str]]:
        """The search space (the preset's params, then the command line's sweeps) and the fixed overrides."""
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
        assert self.config is not None and self.launcher is not None
        space, fixed = self._space(arguments)
        sampler = self.sampler_cfg  # Hydra built it already (a nested _target_), unless it came as a dict
        if sampler is not None and not isinstance(sampler, optuna.samplers.BaseSampler):
            sampler = instantiate(sampler)
        study = optuna.create_study(
            study_name=self.study_name, storage=self.storage, sampler=sampler, direction=self.direction,
            load_if_exists=True,
        )  # fmt: skip
        parent = ParentRun(self.config, space, self)
        base = self.config.run.name

        def plumbing(t) -> list[str]:  # each trial its own checkpoints, its MLflow run under the parent
            return [f"run.name={base}/trial-{t.number:03d}", f"mlflow.parent_run_id={parent.run_id}"]

        done = 0
        while done < self.n_trials:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            batch = [tuple(fixed + [_override(k, t.params[k]) for k in space] + plumbing(t)) for t in trials]
            self.validate_batch_is_legal(batch)
            returns = self.launcher.launch(batch, initial_job_idx=self.job_idx)
            self.job_idx += len(returns)
            for t, r in zip(trials, returns):
                value = _value(r)
                if value is None:
                    study.tell(t, state=TrialState.FAIL)
                    log.warning("trial %d failed or returned no %s", t.number, self.metric)
                else:
                    study.tell(t, value)
                parent.trial(t.number, value)
            done += len(trials)
        ok = [t for t in study.trials if t.state == TrialState.COMPLETE]
        best = {
            "name": "optuna",
            "metric": self.metric,
            "direction": self.direction,
            "trials": len(study.trials),
        }
        if ok:
            best.update(
                best_value=study.best_value, best_params=study.best_params, best_trial=study.best_trial.number
            )
        parent.finish(best)
        out = f"{self.config.hydra.sweep.dir}/optimization_results.yaml"
        OmegaConf.save(OmegaConf.create(best), out)
        log.info("hparams search: %s (%s)", best, out)
        return best


def _override(key: str, value) -> str:
    return f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"


def _value(r) -> float | None:
    try:
        v = r.return_value  # re-raises a failed job's exception
    except Exception as e:
        log.warning("trial job failed: %r", e)
        return None
    if v is None or isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
        return None
    return float(v)


class ParentRun:
    """The sweep's MLflow run; the trials nest under it. Tracking must never stop the search."""

    def __init__(self, config: DictConfig, space: dict, sweeper: OptunaSweeper):
        from goodput.tracking import _retry, flatten, start_run

        self.run_id, self._retry = None, _retry
        m = config.mlflow
        try:
            settings = {
                "metric": sweeper.metric,
                "direction": sweeper.direction,
                "n_trials": sweeper.n_trials,
            }
            params = flatten({"search": {k: repr(d) for k, d in space.items()}, "sweeper": settings})
            self.run_id = start_run(
                m.tracking_uri, m.experiment, f"{config.run.name}/search", params, None, m.artifact_location,
                tags={"goodput.sweep": "optuna"},
            )  # fmt: skip
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(m.tracking_uri)
        except Exception as e:
            log.warning("hparams search: no MLflow parent run (%s); the trials are logged alone", e)

    def trial(self, number: int, value: float | None) -> None:
        if self.run_id and value is not None:
            self._call(self.client.log_metric, self.run_id, "trial_value", value, step=number)

    def finish(self, best: dict) -> None:
        if not self.run_id:
            return
        if "best_value" in best:
            self._call(self.client.log_metric, self.run_id, "best_value", best["best_value"])
            for k, v in best["best_params"].items():
                self._call(self.client.log_param, self.run_id, f"best.{k}", v)
        self._call(self.client.set_terminated, self.run_id, "FINISHED")

    def _call(self, fn, *args, **kw) -> None:
        try:
            self._retry(fn, *args, **kw)
        except Exception as e:
            log.warning("hparams search: MLflow %s failed: %s", getattr(fn, "__name__", fn), e)
