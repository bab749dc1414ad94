"""A Hydra sweeper that searches hyperparameters with Optuna (>= 4): `hparams_search=...` presets.

Why not hydra-optuna-sweeper: its newest release (1.3.0) pins `optuna<3.0`, so it cannot be
installed beside today's Optuna (5.0 when this was written); it would downgrade Optuna to 2.10.
This plugin keeps that plugin's config shape (`hydra.sweeper.params` in Hydra's sweep syntax:
`interval(a, b)`, `tag(log, interval(a, b))`, `choice(a, b)`, `range(a, b, step)`; `direction`,
`n_trials`, `n_jobs`, `sampler`, `study_name`, `storage`), so a preset moves to it unchanged, and
asks Optuna for trials through its ask/tell API. The task function (scripts/train.py) returns the
value of `metric`; a trial that fails or returns nothing is told to Optuna as failed.

MLflow: the sweep is one parent run (its search space as params, each trial's value as the
metric `trial_value`, the best as `best_value` and params `best.*`); every trial is its own run,
nested under the parent (`mlflow.parent_run_id`, MLflow's `mlflow.parentRunId` tag).
"""

from hydra_plugins.goodput_optuna_sweeper.sweeper import OptunaSweeper

__all__ = ["OptunaSweeper"]
