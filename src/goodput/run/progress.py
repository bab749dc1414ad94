"""What rank 0 shows while a run trains: tqdm's bar on a terminal; elsewhere (a file, a SLURM log,
a pipe) a log line every `trainer.progress_every_s` seconds, and one line per evaluation in both.

The loop hands over only what it already synchronised for its metrics (the loss is read at log
steps), so showing progress adds no device synchronisation."""

from __future__ import annotations

import logging
import sys
import threading
import time

from tqdm import tqdm

log = logging.getLogger(__name__)

MODES = ("auto", "bar", "lines", True, False)  # trainer.progress; true = bar, false = neither


class Progress:
    def __init__(self, mode, every_s: float, step: int, max_steps: int, rank: int):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        mode = {True: "bar", False: None}.get(mode, mode) if rank == 0 else None
        self.lines, self.every_s, self.max_steps = mode == "lines", every_s, max_steps
        # tqdm's default lock holds a multiprocessing RLock, a named semaphore the resource tracker
        # of the elastic agent's process records. A rank that is SIGKILLed (a fault) or ends by
        # os._exit (a survivor, fail_fast) never releases it, and the job ends with "There appear
        # to be N leaked semaphore objects". Only this thread of this process writes the bar.
        tqdm.set_lock(threading.RLock())
        self.bar = tqdm(total=max_steps, initial=step, disable=mode != "bar", dynamic_ncols=True)
        self.first, self.t0, self.shown = step, time.monotonic(), None  # this attempt's start

    def logged(self, step: int, loss: float, lr: float, images_s: float, fetch_s: float) -> None:
        """At a step that logged its metrics: the bar's numbers, or a line when one is due."""
        self.bar.set_postfix(
            loss=f"{loss:.3f}", fetch=f"{fetch_s:.3f}s", img_s=f"{images_s:.0f}", refresh=False
        )
        now = time.monotonic()
        due = self.shown is None or now - self.shown >= self.every_s or step == self.max_steps
        if not (self.lines and due):
            return
        self.shown = now
        per_step = (now - self.t0) / max(1, step - self.first)  # evaluations and saves included
        log.info(
            "step %d/%d (%d%%)  loss %.4f  lr %.4g  %.0f img/s  eta %s", step, self.max_steps,
            100 * step // self.max_steps, loss, lr, images_s, duration((self.max_steps - step) * per_step),
        )  # fmt: skip

    def advance(self) -> None:
        self.bar.update(1)

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        if self.lines or not self.bar.disable:
            # the task's summary figures (goodput.recipe.metrics), not the per-class ones
            shown = {"val/loss", "val/accuracy"}
            extra = "".join(
                f", {k[4:]} {v:.4f}" for k, v in metrics.items() if k not in shown and k.count("/") == 1
            )
            log.info(
                "eval at step %d: val loss %.4f, accuracy %.4f%s",
                step, metrics["val/loss"], metrics["val/accuracy"], extra,
            )  # fmt: skip

    def close(self) -> None:
        self.bar.close()


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def done_line(summary: dict) -> str:
    """The job's last line for a finished run: steps, the final loss, the task's headline validation
    metrics (every `val/<name>` the last evaluation gave but the loss and per-class entries: accuracy
    and top-5 for classification; accuracy (exact match), F1 and mAP for multilabel; a metric of
    your own too) and goodput."""
    val = [
        f"{k[4:]} {v:.4g}"
        for k, v in (summary.get("val") or {}).items()
        if k != "val/loss" and k.count("/") == 1
    ]
    shown = " ".join(val) or "not evaluated"
    g = 100 * summary["goodput"]["goodput"]
    return f"done: {summary['steps']} steps, loss {summary['final_loss']:.4f}, val {shown}, goodput {g:.1f}%"
