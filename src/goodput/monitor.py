"""Watching one validation metric across evaluations: the best-so-far (checkpoint.keep_best_by) and
early stopping (trainer.early_stopping_*). Which metrics there are is the task's
(goodput.recipe.task metric_modes; checked by goodput.config.monitors_logged). Both are Stateful
parts of the checkpoint (global JSON, the same on every rank), so a resumed or resharded run
continues the same comparison and stops at the same step as an uninterrupted one."""

from __future__ import annotations

import logging
import math

from goodput.untrusted import RecordError, field

log = logging.getLogger(__name__)


def mode_of(name: str | None, mode: str | None) -> str:
    """`max` or `min`; null = from the name (a loss falls, anything else rises). The Trainer gives
    the task's own mode of a metric (goodput.recipe.task metric_modes) where the config says none."""
    if mode is not None:
        return mode
    return "min" if name is not None and name.endswith("loss") else "max"


def _better(value: float, ref: float | None, mode: str, min_delta: float = 0.0) -> bool:
    if math.isnan(value):
        return False
    if ref is None:
        return True
    return value > ref + min_delta if mode == "max" else value < ref - min_delta


def _value(metrics: dict, name: str) -> float:
    if name not in metrics:
        raise KeyError(f"the monitored metric {name!r} is not among this evaluation's {sorted(metrics)[:6]}")
    return float(metrics[name])


class Best:
    """The best evaluation so far of metric `by` (None = off): its step and value."""

    def __init__(self, by: str | None, mode: str | None):
        self.by, self.mode, self._given = by, mode_of(by, mode), mode
        self.step: int | None = None
        self.value: float | None = None
        self.last: tuple[int, float] | None = None  # the newest evaluation (its commit records it)

    def take_modes(self, modes: dict[str, str]) -> None:
        """Where checkpoint.keep_best_mode is null: the task's mode of the metric (metric_modes)."""
        if self._given is None and self.by in modes:
            self.mode = modes[self.by]

    def observe(self, metrics: dict, step: int) -> bool:
        """Record an evaluation; True when it is a new best (the step is then worth a checkpoint)."""
        if self.by is None:
            return False
        v = _value(metrics, self.by)
        self.last = (step, v)
        if _better(v, self.value, self.mode):
            self.step, self.value = step, v
            return True
        return False

    def describe(self) -> dict | None:
        if self.by is None or self.step is None:
            return None
        return {"by": self.by, "mode": self.mode, "step": self.step, "value": self.value}

    def state_dict(self) -> dict:
        return {"by": self.by, "mode": self.mode, "step": self.step, "value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        """Checked as untrusted input (RecordError: AppState then starts the best over, warned)."""
        _check(sd, "best", by=str, mode=str)
        if (sd.get("by"), sd.get("mode")) != (self.by, self.mode):
            if self.by is not None and sd.get("by") is not None:
                log.warning(
                    "checkpoint.keep_best_by changed from %s (%s) to %s (%s): the best so far starts over",
                    sd.get("by"), sd.get("mode"), self.by, self.mode,
                )  # fmt: skip
            return
        self.step, self.value = _check(sd, "best", step=int, value=float)


class EarlyStopping:
    """Stop when `by` has not improved by more than `min_delta` for `patience` evaluations in a row
    (patience None = off)."""

    def __init__(self, patience: int | None, by: str, min_delta: float, mode: str | None):
        self.patience, self.by, self.min_delta, self.mode = patience, by, min_delta, mode_of(by, mode)
        self.best: float | None = None
        self.bad = 0  # evaluations in a row without an improvement
        self.stopped_at: int | None = None

    def update(self, metrics: dict, step: int) -> bool:
        """Record an evaluation; True when training should stop now."""
        if self.patience is None:
            return False
        v = _value(metrics, self.by)
        if _better(v, self.best, self.mode, self.min_delta):
            self.best, self.bad = v, 0
        else:
            self.bad += 1
        if self.bad >= self.patience:
            self.stopped_at = step
            return True
        return False

    def detail(self) -> str:
        return (
            f"{self.by} did not improve by more than {self.min_delta} "
            f"({self.mode}) for {self.patience} evaluations; best {self.best}"
        )

    def state_dict(self) -> dict:
        return {"by": self.by, "best": self.best, "bad": self.bad, "stopped_at": self.stopped_at}

    def load_state_dict(self, sd: dict) -> None:
        """Checked as untrusted input (RecordError: AppState then starts the counter over, warned)."""
        _check(sd, "early_stopping", by=str)
        if sd.get("by") != self.by:  # another monitor: its counter says nothing about this one
            return
        best, bad, stopped_at = _check(sd, "early_stopping", best=float, bad=int, stopped_at=int)
        if bad is None:
            raise RecordError(
                "checkpoint entry extra.early_stopping: no count of evaluations without improvement ('bad')"
            )
        self.best, self.bad, self.stopped_at = best, bad, stopped_at


def _check(sd: object, what: str, **kinds) -> list:
    """The values of `kinds`' keys in a monitor's saved state `sd` (checkpoint entry extra.<what>),
    each None or of its kind (float: any finite number; int: >= 0); RecordError naming the entry and
    the key otherwise."""
    where = f"checkpoint entry extra.{what}"
    if not isinstance(sd, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(sd).__name__}")
    out = []
    for key, kind in kinds.items():
        v = field(
            sd, key, (int, float, type(None)) if kind is float else (kind, type(None)), where, default=None
        )
        if kind is int and v is not None:
            field(sd, key, int, where, minimum=0)
        out.append(v)
    return out
