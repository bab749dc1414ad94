"""The Optuna side of a search: the search space, which study a launch continues, what a relaunch
finds in it, and which trials count.

Imported when a search starts, not while Hydra discovers plugins (the leading underscore keeps the
scanner out): optuna takes about a second to import, and every `--help` would pay for it.

What makes two launches the same search (`definition`): the search space, the fixed overrides of
the command line, the objective and the base run's name (under which every trial runs). The
default study name carries a digest of it, so the same command continues its study and a changed
space, objective or command starts a new one (the log names what differs from the last study of
that run). An explicit `hydra.sweeper.study_name` whose stored study searches something else is
refused. `hydra.sweeper.n_trials` is not part of it: raising it continues the study.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import optuna
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, Trial, TrialState

from goodput.errors import UserError

log = logging.getLogger("hydra_plugins.goodput_optuna_sweeper")

# Study user attributes
DEFINITION = "goodput.search"  # what the study searches: `definition()`
PARENT_RUN = "goodput.mlflow_parent_run_id"  # the search's MLflow run, continued on relaunch
# Trial user attributes
RUN_NAME = "goodput.run_name"  # the run the trial trains (its checkpoints, its MLflow run)
RESUMES = "goodput.resumes"  # the number of the interrupted trial whose run this one continues
ERROR = "goodput.error"  # why it failed, in one line

FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


class SearchRefused(UserError, ValueError):
    pass


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


def definition(space: dict, fixed: list[str], metric: str, direction: str, run: str) -> dict:
    """What a search is (see the module docstring), as stored in its study."""
    return {
        "run": run,
        "metric": metric,
        "direction": direction,
        "space": {k: repr(d) for k, d in sorted(space.items())},
        "fixed": sorted(fixed),
    }


def default_name(d: dict) -> str:
    digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    return f"{d['run']}/search-{digest}"


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two definitions, one entry per key or override."""
    out = [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in ("run", "metric", "direction")
        if old.get(k) != new[k]
    ]
    old_space, new_space = old.get("space", {}), new["space"]
    for k in sorted(set(old_space) | set(new_space)):
        if old_space.get(k) != new_space.get(k):
            out.append(f"{k}: {old_space.get(k, 'not searched')} -> {new_space.get(k, 'not searched')}")
    old_fixed, new_fixed = set(old.get("fixed", [])), set(new["fixed"])
    out += [f"override {o} only in the old command" for o in sorted(old_fixed - new_fixed)]
    out += [f"override {o} only in this command" for o in sorted(new_fixed - old_fixed)]
    return out


def storage_url(url: str | None) -> str | None:
    """The RDB URL Optuna opens: a SQLite file by its absolute path, its directory created."""
    if not url or not url.startswith("sqlite:///"):
        return url or None
    path = url[len("sqlite:///") :]
    if "://" in path:
        raise SearchRefused(
            f"hydra.sweeper.storage={url}: a SQLite file must be a local path (paths.root is a URL?): "
            "set hydra.sweeper.storage to a local sqlite:///... file or an RDB server (postgresql://...)"
        )
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"sqlite:///{path}"


def open_study(name: str, storage: str | None, direction: str, d: dict, explicit: bool) -> optuna.Study:
    """The study `name` (created, or continued when it searches the same), refused when it holds
    another search."""
    if storage is not None and not explicit:
        _note_new(name, storage, d)
    study = optuna.create_study(study_name=name, storage=storage, direction=direction, load_if_exists=True)
    stored = study.user_attrs.get(DEFINITION)
    if stored is None and study.trials:
        raise SearchRefused(
            f"hydra.sweeper.study_name={name}: that study has {len(study.trials)} trials but no record "
            "of what it searches (made outside this sweeper?): use another study_name"
        )
    if stored is not None and stored != d:
        raise SearchRefused(
            f"hydra.sweeper.study_name={name}: the stored study searches something else ("
            + "; ".join(differences(stored, d))
            + "): use another study_name, or the command that made it"
        )
    if stored is None:
        study.set_user_attr(DEFINITION, d)
    return study


def _note_new(name: str, storage: str, d: dict) -> None:
    """Say why a default-named search starts a new study when its run has searched before."""
    prefix = f"{d['run']}/search-"
    try:
        studies = optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception:  # a new or unreadable storage: create_study says what is wrong
        return
    if any(s.study_name == name for s in studies):
        return
    older = [s for s in studies if s.study_name.startswith(prefix) and DEFINITION in s.user_attrs]
    if older:
        last = max(older, key=lambda s: s.datetime_start.timestamp() if s.datetime_start else 0.0)
        log.info(
            "hparams search: new study %s, not %s (%s)",
            name, last.study_name, "; ".join(differences(last.user_attrs[DEFINITION], d)),
        )  # fmt: skip


def interrupted(study: optuna.Study) -> set[int]:
    """Numbers of the trials that were cut off and continued by a later trial (they do not count)."""
    return {t.user_attrs[RESUMES] for t in study.get_trials(deepcopy=False) if RESUMES in t.user_attrs}


def counted(study: optuna.Study) -> list[FrozenTrial]:
    """The trials `n_trials` counts: finished (complete, failed, pruned), not cut off."""
    cut = interrupted(study)
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED) if t.number not in cut]


def interrupt(study: optuna.Study, trial: Trial | FrozenTrial, why: str) -> None:
    """A trial that did not finish (the search was killed or stopped): failed in the study, and its
    parameters queued again under its run name, so the next ask continues its run from its newest
    checkpoint (and its MLflow run) instead of sampling a new point."""
    if isinstance(trial, Trial):
        trial.set_user_attr(ERROR, why)
    study.tell(trial.number, state=TrialState.FAIL)
    run_name = trial.user_attrs.get(RUN_NAME)
    study.enqueue_trial(dict(trial.params), user_attrs={RUN_NAME: run_name, RESUMES: trial.number})
    log.warning(
        "hparams search: trial %d (%s) %s: it continues in the next trial", trial.number, run_name, why
    )


def recover(study: optuna.Study) -> None:
    """Trials a killed search left RUNNING (the caller holds the search's lock: nobody runs them)."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        interrupt(study, t, "was running when the search process ended")


def sampler(cfg, trials: int):
    """The configured sampler (`hydra.sweeper.sampler`, a `_target_` node) for a study that already
    holds `trials` trials: its seed plus that count. With the seed itself a relaunch would draw the
    first launch's points again (the random start-up trials of TPE come from that seed)."""
    from hydra.utils import instantiate

    if cfg is None:
        return None
    seed = cfg.get("seed")
    return instantiate(cfg, **({} if seed is None else {"seed": int(seed) + trials}))
