"""Resume: which checkpoint a start should load, and loading it on every rank. One call from a worker.

`run.resume` is `auto` (the newest commit of this run), `none` (start fresh), or a committed step
dir of this run's `checkpoint.dir`. An elastic restart always continues from the newest commit:
re-applying `none` or an explicit step would throw the progress since then away.

`run.init_from` (a warm start) applies only when nothing of the run itself was loaded: the weights of
another run's checkpoint or export go into the model (and its EMA); the optimizer, the LR schedule,
the step and the data position stay as a fresh start has them. A relaunch of such a run finds its
own commit and resumes that.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.optim.swa_utils import AveragedModel

from goodput.checkpoint.export import Weights, read_weights
from goodput.checkpoint.manager import CheckpointManager
from goodput.checkpoint.state import AppState
from goodput.errors import IncompatibleCheckpoint, UserError
from goodput.resilience.accounting import restart_round

log = logging.getLogger(__name__)


def effective_spec(configured: str) -> str:
    if restart_round() > 0:
        return "auto"
    return str(configured)


def _candidates(mgr: CheckpointManager, spec: str) -> list[dict]:
    """Rank 0 decides what to try; every rank gets the same list (or the same error)."""
    out = [None, None]
    if mgr.rank == 0:
        try:
            if spec == "auto":
                mgr.clean_incomplete()
                out[0] = mgr.committed()
            elif spec == "none":
                out[0] = []
            else:
                out[0] = [mgr.commits.resolve(spec)]
        except Exception as e:
            out[1] = f"{type(e).__name__}: {e}"
    if mgr.world > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        raise RuntimeError(f"could not list checkpoints: {out[1]}")
    return out[0]


def resume(
    mgr: CheckpointManager, app: AppState, configured: str, ahead: Callable[[int], None] | None = None
) -> tuple[dict | None, bool]:
    """Load what `run.resume` asks for, collectively. Returns (commit record or None, touched):
    `touched` means a failed load may have written into the live state, which must be rebuilt.
    `ahead(step)` is told the step the start will most likely continue at (the first candidate's),
    before anything is read: the data loader starts making its batches meanwhile."""
    spec = effective_spec(configured)
    candidates = _candidates(mgr, spec)
    if ahead is not None:
        ahead(candidates[0]["step"] if candidates else 0)
    rec, skipped = mgr.restore(app, candidates)
    for s in skipped:
        log.warning("could not load checkpoint %s; falling back to the previous one", s)
    if spec not in ("auto", "none") and rec is None:
        raise RuntimeError(f"run.resume={configured} could not be loaded: {skipped}")
    if mgr.rank == 0 and spec != "none":
        mgr.supersede_after(rec["step"] if rec else -1)
    if rec:
        log.info("resumed from %s (step %d)", mgr.storage.url(rec["dir"]), rec["step"])
    elif skipped:
        log.warning("no committed checkpoint could be loaded: starting from scratch")
    return rec, bool(skipped) and rec is None


class InitFromError(IncompatibleCheckpoint):
    """run.init_from names weights that do not fit this run's model (names, shapes, classes)."""


def init_from(
    mgr: CheckpointManager,
    app: AppState,
    resumed: dict | None,
    source: str | None,
    classes: list[str],
    open_storage: Callable,
    node: dict | None = None,
) -> Weights | None:
    """run.init_from: when the start `resumed` nothing, load the weights of `source` into the model and
    the EMA (every rank reads them, then all agree before any is loaded: the load is collective under
    FSDP). Strict: a missing or unexpected name or another shape is an InitFromError naming them, and
    the arguments where the source's model record differs from this run's model `node`; another
    number of classes says so, with both lists."""
    if not source:
        return None
    if resumed is not None:
        log.info("run.init_from=%s not applied: this run resumed its own checkpoint (step %d)",
                 source, resumed["step"])  # fmt: skip
        return None
    got, err = None, None
    try:
        got = read_weights(source, "model", open_storage=open_storage)
        fit(app.model, got, classes, node)
    except Exception as e:
        err = e
    if not mgr._agree(err is None):  # (a rank that failed to read would leave the others in a collective)
        if err is None:
            raise InitFromError(f"run.init_from={source}: failed on another rank")
        if isinstance(err, InitFromError):
            raise err
        why = err if isinstance(err, UserError) else f"{type(err).__name__}: {err}"  # a UserError names it
        raise InitFromError(f"run.init_from={source}: {why}") from err
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(app.model, got.state, options=full)
    for m in app.modules.values():  # the EMA starts from the same weights as the model
        if isinstance(m, AveragedModel):
            set_model_state_dict(m.module, got.state, options=full)
    log.info(
        "run.init_from: the model starts from %s%s; optimizer, LR schedule, step and data position "
        "start fresh", got.origin, f" (step {got.step})" if got.step is not None else "",
    )  # fmt: skip
    return got


def fit(model, got: Weights, classes: list[str], node: dict | None = None) -> None:
    """InitFromError unless `got.state` has exactly the model's names and shapes (naming the arguments
    where the source's model record differs from `node`, this run's model node)."""
    live = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}  # global shapes (DTensor too)
    src = {k: tuple(v.shape) for k, v in got.state.items()}
    theirs = None
    if got.record is not None:  # a source with a model record: name the classes when they differ
        theirs = got.spec().classes
    if theirs is not None and len(theirs) != len(classes):
        raise InitFromError(
            f"run.init_from={got.origin} has {len(theirs)} classes {theirs[:10]}, this run's data has "
            f"{len(classes)} {classes[:10]}: the classifier head has another shape (num_classes)"
        )
    missing, unexpected = sorted(live.keys() - src.keys()), sorted(src.keys() - live.keys())
    differ = [k for k in sorted(live.keys() & src.keys()) if src[k] != live[k]]
    parts = [
        f"missing {missing[:5]}" if missing else "",
        f"unexpected {unexpected[:5]}" if unexpected else "",
    ]
    if differ:
        parts.append("shapes differ (source vs this model): " + ", ".join(f"{k} {src[k]} vs {live[k]}"
                                                                        for k in differ[:5]))  # fmt: skip
    if any(live[k][:1] == (len(classes),) for k in differ):
        parts.append(f"this run has {len(classes)} classes: another num_classes?")
    if any(parts) and node is not None and got.record is not None:
        src_node, show = got.spec().node, lambda v: json.dumps(v, default=str)
        args = [
            f"{k} {show(src_node.get(k))} (this run: {show(node.get(k))})"
            for k in sorted(set(src_node) | set(node))
            if k != "num_classes" and src_node.get(k) != node.get(k)
        ]
        if args:
            parts.append(f"its model record ({got.origin}) differs: {', '.join(args[:5])}")
    if any(parts):
        raise InitFromError(
            f"run.init_from={got.origin} does not fit this run's model: " + "; ".join(p for p in parts if p)
        )
    if theirs is not None and theirs != classes:
        log.warning(
            "run.init_from=%s was trained on classes %s, this run's are %s (same number: label i maps "
            "to another class)", got.origin, theirs[:10], classes[:10],
        )  # fmt: skip
