"""A Hydra sweeper that searches hyperparameters with Optuna (>= 4): `-m hparams_search=...` presets.

Why not hydra-optuna-sweeper: its newest release (1.3.0) pins `optuna<3.0`, so it cannot be
installed beside today's Optuna (5.0 when this was written); it would downgrade Optuna to 2.10.
This plugin keeps that plugin's config shape (`hydra.sweeper.params` in Hydra's sweep syntax:
`interval(a, b)`, `tag(log, interval(a, b))`, `choice(a, b)`, `range(a, b, step)`; `direction`,
`n_trials`, `n_jobs`, `sampler`, `study_name`, `storage`), so a preset moves to it unchanged, and
asks Optuna for trials through its ask/tell API. The task function (scripts/train.py) returns the
run's summary; its `val[metric]` is the trial's value.

A search survives its process: the study lives in an RDB storage (SQLite under paths.root by
default) and a relaunch of the same command continues it (_study: what "the same" is). Completed
and failed trials are kept; a trial the search was killed or stopped in is recorded failed and its
parameters queued again under its run name, so the next trial resumes that run from its newest
checkpoint; `n_trials` counts the study's finished trials, the cut-off ones excepted. A trial whose
job fails (a config refusal, a crash, no metric) is a FAIL trial and the search goes on.

MLflow (_runs): the study is one parent run (its search space as params, each trial's value as the
metric `trial_value`, the best as `best_value` and tags `best.*`), continued on relaunch; every
trial is its own run nested under it (`mlflow.parent_run_id`, MLflow's `mlflow.parentRunId` tag),
tagged `goodput.optuna_trial`; a trial that failed before opening one gets a FAILED run.
"""

from hydra_plugins.goodput_optuna_sweeper.sweeper import OptunaSweeper

__all__ = ["OptunaSweeper"]
