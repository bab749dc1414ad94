"""Monte-Carlo of a job's month under failures: the spread the closed forms average away.

The model (the one `goodput` solves to first order, and `renewal_goodput` exactly for Poisson
failures and no commit delay):
- The job runs for a fixed window of wall time (`days`), from a fresh start (no restart at t = 0).
- Work comes in segments of `interval_minutes` of wall time: compute for the interval minus the
  save stall, then a save that stalls the loop for `save_stall_seconds` and is committed
  `commit_delay_seconds` after the stall ends (0 for a synchronous save; an async save's upload
  runs while training goes on). One save is in flight at a time: the delay fits in a segment.
- Failures hit the job at any moment, computing, saving or restarting. The times between failures
  are independent draws with mean 24 / interruptions_per_day hours: exponential (a Poisson process,
  `weibull_shape` None or 1) or Weibull with that shape (< 1: failures cluster; > 1: wear-out).
  Each failure renews the clock (the failed hardware is replaced).
- A failure throws away everything since the last *committed* save (compute, and the stalls of
  saves that had not committed yet), then the job pays `restart_minutes` before computing again;
  a failure during the restart starts the restart over. Every restart resumes from a committed
  save, so segments restart in phase.
- Rescue checkpoints: with probability `rescue_probability`, drawn per failure, a surviving rank
  saves the last finished step instead: the failure loses one step (`step_seconds`, the step in
  flight counted whole; never more than the time since the last save, which the rescue is newer
  than) and no commit delay. The restart then resumes in phase as well, as if the rescue were a
  save: a simplification that skips at most one save's stall per rescued failure.
- At the window's end the work done since the last save counts as done (the window is a slice of a
  longer job that carries on), a save in progress counts as stall.
goodput = compute that survives / window; lost GPU-hours = gpus * (window - surviving compute).

Vectorized per failure, not per segment: between two failures the job completes floor(x / a)
segments of the x seconds it computed, so a month at thousands of GPUs is a few hundred draws.
"""

from __future__ import annotations

import math

import numpy as np

from goodput.calculator import (
    InputError,
    _commit_fits,
    _count,
    _interval_fits,
    _non_negative,
    _positive,
    _rescue,
    _restart_fits,
    _step_fits,
    goodput,
    lost_work_per_failure_seconds,
    renewal_goodput,
)

_CELLS = 1 << 21  # failure draws per batch (trials x failures per trial): bounds memory near 200 MB
_MAX_DRAWS = 2e8  # beyond this a run takes minutes: ask for fewer trials or days instead


def _gaps(rng: np.random.Generator, shape: tuple[int, int], mean: float, weibull: float | None):
    if weibull is None or weibull == 1:
        return rng.exponential(mean, shape)
    return rng.weibull(weibull, shape) * (mean / math.gamma(1 + 1 / weibull))


def _trials(rng, n: int, horizon: float, lam: float, a: float, c: float, r: float, d: float, weibull,
            rescue: tuple[float, float, np.random.Generator] | None = None):  # fmt: skip
    """Per trial: surviving compute, redone work, restart time, save stall (seconds), failures.
    `rescue`: (probability, step seconds, the generator that draws which failures are rescued)."""
    if lam == 0:
        full, rem = divmod(horizon, a)
        useful = full * (a - c) + min(rem, a - c)
        z = np.zeros(n)
        return np.full(n, useful), z, z, np.full(n, horizon - useful), z
    mean = 1 / lam
    k = int(horizon * lam + 6 * math.sqrt(horizon * lam) + 8)  # enough for all but ~1e-9 of trials
    times = np.cumsum(_gaps(rng, (n, k), mean, weibull), axis=1)
    while (times[:, -1] < horizon).any():  # rare: draw more failures for the trials still short
        more = np.cumsum(_gaps(rng, (n, k), mean, weibull), axis=1) + times[:, -1:]
        times = np.concatenate([times, more], axis=1)
    starts = np.concatenate([np.zeros((n, 1)), times[:, :-1]], axis=1)  # period j: failure j to j+1
    live = starts < horizon
    failed = times < horizon  # the period ended by a failure, not by the window's end
    length = np.where(live, np.minimum(times, horizon) - starts, 0.0)
    restart = np.full((1, times.shape[1]), r)
    restart[0, 0] = 0.0  # the first period is the job's start, not a restart
    restarting = np.minimum(length, restart)
    x = length - restarting  # seconds spent computing or saving in this period
    done, rem = np.divmod(x, a)  # saves whose stall ended, and the time since the last one
    committed = np.floor(np.maximum(x - d, 0.0) / a)  # ... and those also committed
    work = a - c
    kept = np.where(failed, committed, done)  # at the window's end the job carries on: nothing lost
    tail = np.where(failed, 0.0, rem)  # what survives after the last kept save
    if rescue is not None:
        p, step, draws = rescue
        rescued = failed & (draws.random(x.shape) < p)
        kept = np.where(rescued, done, kept)  # the rescue is newer than any save, committed or not
        tail = np.where(rescued, rem - np.minimum(step, rem), tail)
    useful = kept * work + np.minimum(tail, work)
    stall = kept * c + np.maximum(tail - work, 0.0)
    redone = np.where(failed, x - kept * a - tail, 0.0)
    return useful.sum(1), redone.sum(1), restarting.sum(1), stall.sum(1), failed.sum(1)


def simulate(
    interruptions_per_day: float,
    interval_minutes: float,
    save_stall_seconds: float = 0.0,
    restart_minutes: float = 0.0,
    *,
    days: float = 30.0,
    gpus: int = 1,
    trials: int = 10_000,
    seed: int = 0,
    weibull_shape: float | None = None,
    commit_delay_seconds: float = 0.0,
    rescue_probability: float = 0.0,
    step_seconds: float | None = None,
) -> dict[str, float]:
    """Distribution of goodput and lost GPU-hours over `trials` seeded runs of the model above."""
    _non_negative("interruptions_per_day", interruptions_per_day)
    _positive("interval_minutes", interval_minutes)
    _non_negative("save_stall_seconds", save_stall_seconds)
    _non_negative("restart_minutes", restart_minutes)
    _positive("days", days)
    _count("gpus", gpus)
    _count("trials", trials)
    if weibull_shape is not None:
        _positive("weibull_shape", weibull_shape)
    _rescue(rescue_probability, step_seconds)
    _interval_fits(interval_minutes, save_stall_seconds)
    _commit_fits(interval_minutes, save_stall_seconds, commit_delay_seconds)
    _step_fits(interval_minutes, save_stall_seconds, step_seconds)
    if interruptions_per_day > 0:
        _restart_fits(restart_minutes, 24 / interruptions_per_day)
    horizon = days * 86400
    lam = interruptions_per_day / 86400
    a, c, r = interval_minutes * 60, save_stall_seconds, restart_minutes * 60
    per_trial = horizon * lam + 6 * math.sqrt(horizon * lam) + 8
    if trials * per_trial > _MAX_DRAWS:
        raise InputError(
            "trials",
            f"is too large for this failure rate: {trials} trials x ~{per_trial:.0f} failures each "
            f"> {_MAX_DRAWS:.0e} draws; lower it or the days",
        )
    batch = max(1, min(trials, int(_CELLS / per_trial)))
    rng = np.random.default_rng(seed)
    # Rescues drawn from a stream of their own: the same seed gives the same failure times at any p.
    rescue = (
        (rescue_probability, step_seconds, np.random.default_rng([seed, 1])) if rescue_probability else None
    )
    parts = [_trials(rng, min(batch, trials - i), horizon, lam, a, c, r, commit_delay_seconds, weibull_shape,
                     rescue) for i in range(0, trials, batch)]  # fmt: skip
    useful, redone, restarting, stall, failures = (np.concatenate(p) for p in zip(*parts))
    g = useful / horizon
    lost_gpu_hours = gpus * (horizon - useful) / 3600
    gp = np.percentile(g, [10, 50, 90])
    lp = np.percentile(lost_gpu_hours, [10, 50, 90])
    args = (interruptions_per_day, interval_minutes, save_stall_seconds, restart_minutes)
    rescue_args = {"rescue_probability": rescue_probability, "step_seconds": step_seconds}
    closed = goodput(*args, commit_delay_seconds=commit_delay_seconds, **rescue_args)
    # The renewal form has no commit delay (a failure in it reaches back two segments) and no rescue.
    exact = renewal_goodput(*args) if commit_delay_seconds == 0 and rescue_probability == 0 else None
    mean = float(g.mean())
    return {
        "goodput_mean": mean,
        "goodput_p10": float(gp[0]),
        "goodput_p50": float(gp[1]),
        "goodput_p90": float(gp[2]),
        "goodput_std": float(g.std()),
        "goodput_sem": float(g.std() / math.sqrt(trials)),
        "lost_gpu_hours_mean": float(lost_gpu_hours.mean()),
        "lost_gpu_hours_p10": float(lp[0]),
        "lost_gpu_hours_p50": float(lp[1]),
        "lost_gpu_hours_p90": float(lp[2]),
        "failures_mean": float(failures.mean()),
        "redone_hours_mean": float(redone.mean() / 3600),
        "restart_hours_mean": float(restarting.mean() / 3600),
        "stall_hours_mean": float(stall.mean() / 3600),
        "closed_form_goodput": closed["goodput"],
        "lost_work_per_failure_seconds": lost_work_per_failure_seconds(
            interval_minutes, commit_delay_seconds, rescue_probability, step_seconds
        ),
        "closed_form_difference": mean - closed["goodput"],
        "renewal_goodput": exact,
        "renewal_difference": None if exact is None else mean - exact,
        "interruptions_per_day": interruptions_per_day,
        "interval_minutes": interval_minutes,
        "save_stall_seconds": save_stall_seconds,
        "restart_seconds": r,
        "commit_delay_seconds": commit_delay_seconds,
        "rescue_probability": rescue_probability,
        "step_seconds": step_seconds,
        "days": days,
        "gpus": gpus,
        "trials": trials,
        "seed": seed,
        "weibull_shape": weibull_shape,
    }
