"""The search in MLflow: one parent run per study (continued when the search is relaunched), each
trial's run nested under it, and a FAILED run for a trial that failed before it opened its own.
Tracking must never stop the search: a failing call only warns."""

from __future__ import annotations

import logging

from omegaconf import DictConfig

log = logging.getLogger("hydra_plugins.goodput_optuna_sweeper")

TRIAL_TAG, ERROR_TAG = "goodput.optuna_trial", "goodput.error"


class ParentRun:
    def __init__(self, config: DictConfig, study_name: str, params: dict, run_id: str | None):
        """The study's run: `run_id` (the one a previous launch started) continued, else a new one."""
        from goodput.tracking import _retry, flatten, start_run

        self._retry, self.run_id, self.client = _retry, None, None
        m = config.mlflow
        try:
            self.run_id = start_run(
                m.tracking_uri, m.experiment, study_name, flatten(params), run_id, m.artifact_location,
                tags={"goodput.sweep": "optuna", "goodput.study": study_name},
            )  # fmt: skip
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(m.tracking_uri)
            if self.run_id == run_id:
                self._call(
                    self.client.update_run, run_id, "RUNNING"
                )  # finished or killed before: running again
        except Exception as e:
            log.warning("hparams search: no MLflow parent run (%s); the trials are logged alone", e)

    def trial(self, number: int, value: float | None, summary: dict | None) -> None:
        """A trial that ran: its value on the parent (`trial_value`, step = trial number), its run tagged."""
        if not self.run_id:
            return
        if value is not None:
            self._call(self.client.log_metric, self.run_id, "trial_value", value, step=number)
        run_id = (summary or {}).get("mlflow_run_id")
        if run_id:
            self._call(self.client.set_tag, run_id, TRIAL_TAG, str(number))

    def failed(self, number: int, run_name: str, params: dict, why: str) -> None:
        """A failed trial is a FAILED MLflow run under the parent: its own run when it opened one
        (ended FAILED if its job left it RUNNING), else one made here with its parameters."""
        if not self.run_id:
            return
        try:
            mine = [r for r in self._children() if (r.info.run_name + "/").startswith(run_name + "/")]
            if not mine:
                parent = self._retry(self.client.get_run, self.run_id)
                tags = {"mlflow.parentRunId": self.run_id, TRIAL_TAG: str(number)}
                mine = [
                    self._retry(
                        self.client.create_run, parent.info.experiment_id, run_name=run_name, tags=tags
                    )
                ]
                for k, v in params.items():
                    self._retry(self.client.log_param, mine[0].info.run_id, k, v)
            for r in mine:
                self._retry(self.client.set_tag, r.info.run_id, TRIAL_TAG, str(number))
                self._retry(self.client.set_tag, r.info.run_id, ERROR_TAG, why[:5000])
                if r.info.status == "RUNNING":
                    self._retry(self.client.set_terminated, r.info.run_id, "FAILED")
        except Exception as e:
            log.warning("hparams search: could not record failed trial %d in MLflow: %s", number, e)

    def _children(self) -> list:
        exp = self._retry(self.client.get_run, self.run_id).info.experiment_id
        query = f"tags.`mlflow.parentRunId` = '{self.run_id}'"
        return self._retry(self.client.search_runs, [exp], filter_string=query, max_results=10000)

    def finish(self, best: dict, status: str = "FINISHED") -> None:
        """The best so far (`best_value`, tags `best.<key>`: params cannot change on a relaunch), then
        the run's end: FINISHED, or KILLED when the search was interrupted."""
        if not self.run_id:
            return
        if "best_value" in best:
            self._call(self.client.log_metric, self.run_id, "best_value", best["best_value"])
            self._call(self.client.set_tag, self.run_id, "best_trial", str(best["best_trial"]))
            for k, v in best["best_params"].items():
                self._call(self.client.set_tag, self.run_id, f"best.{k}", str(v))
        self._call(self.client.set_terminated, self.run_id, status)

    def _call(self, fn, *args, **kw) -> None:
        try:
            self._retry(fn, *args, **kw)
        except Exception as e:
            log.warning("hparams search: MLflow %s failed: %s", getattr(fn, "__name__", fn), e)
