"""The task: what a model learns from a batch, and how it is scored (the `task` group).

One object owns the targets, the loss and the metrics, as a LightningModule does. The engine calls
it at these points and nowhere else:

    targets(batch)          the batch's targets, as delivered (CPU tensors)
    weights(batch)          1 for each sample that counts, 0 for padding and skipped files
    soft(targets, n)        the targets as probabilities (n classes), for a batch transform that mixes
    loss(logits, targets)   one loss per sample; the step weighs them and averages over the batch
    metrics(classes, ...)   the state of one evaluation (goodput.recipe.metrics)
    metric_modes(n, top_k)  {name: "min" | "max"} of what every evaluation logs: the names
                            checkpoint.keep_best_by, trainer.early_stopping_by and a search may watch
    predict(...)            the rows scripts/predict.py writes

`task.loss` is any loss module by `_target_` (`task.loss.label_smoothing=0.1` is label smoothing).
The task asks it for one value per sample (`reduction = "none"`, which every torch loss has), so
padding and skipped files weigh nothing, whatever the loss; a loss of your own returns one value
per sample (or per sample and class: the task averages the rest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from goodput.recipe.metrics import ClassificationMetrics, MultilabelMetrics


class TaskError(ValueError):
    pass


class Task:
    """What every task shares: the loss asked per sample, and the weights of a delivered batch."""

    def __init__(self, loss: nn.Module):
        if not callable(loss):
            raise TaskError(f"task.loss must be a loss module (a _target_ node), got {loss!r}")
        if hasattr(loss, "reduction"):  # torch's losses: one value per sample, weighed by the task
            loss.reduction = "none"
        self.criterion = loss

    def weights(self, batch: dict) -> torch.Tensor:
        """1.0 per sample that counts; 0.0 for the padding that evens out the ranks' evaluation
        batches (index -1) and for a file `data.on_bad_sample=skip` skipped (ok 0)."""
        return ((batch["index"] >= 0) & (batch["ok"] > 0)).float()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of each sample, in fp32 whatever the compute dtype."""
        per = self.criterion(logits.float(), targets)
        if per.ndim == 0:
            raise TaskError(
                f"task.loss ({type(self.criterion).__name__}) returned one number for the batch: it must "
                "return one per sample (reduction='none'), which the task weighs (padding counts zero)"
            )
        return per.reshape(len(per), -1).mean(1) if per.ndim > 1 else per

    def mean_loss(self, logits, targets, weights, total) -> torch.Tensor:
        """This part of a batch's share of the batch's mean loss (`total`: the batch's weight)."""
        return (self.loss(logits, targets) * weights).sum() / total


class Classification(Task):
    """One class per image: cross-entropy on the logits (task.loss), accuracy, top-k, per-class
    accuracy and a confusion matrix. Targets are class indices; a label below 0 is no class (the
    dataset's blank sample) and weighs nothing."""

    def __init__(self, loss: nn.Module, top_k: int | None = None):
        super().__init__(loss)
        self.top_k = top_k

    def targets(self, batch: dict) -> torch.Tensor:
        return batch["label"]

    def soft(self, targets: torch.Tensor, num_classes: int) -> torch.Tensor:
        if targets.ndim == 2:
            return targets
        return F.one_hot(targets.clamp(min=0), num_classes).float() * (targets >= 0)[:, None]

    def loss(self, logits, targets):
        return super().loss(logits, targets if targets.ndim == 2 else targets.clamp(min=0))

    def top(self, num_classes: int | None) -> int | None:
        """k of val/top<k>: task.top_k (trainer.eval_top_k), or 5 from 5 classes up (None: no top-k);
        `num_classes` None = not known yet (before the data is listed)."""
        if self.top_k is not None:
            return self.top_k
        return 5 if num_classes is None or num_classes >= 5 else None

    def metric_modes(self, num_classes: int | None) -> dict[str, str]:
        modes = {"val/loss": "min", "val/accuracy": "max"}
        k = self.top(num_classes)
        if k is not None:
            modes[f"val/top{k}"] = "max"
        return modes

    def metrics(self, classes: list[str], split: str = "val") -> ClassificationMetrics:
        return ClassificationMetrics(self, classes, self.top(len(classes)), split)

    def predict_header(self, k: int) -> list[str]:
        return ["path", "class", "probability", f"top{k}"]

    def predict(self, logits: torch.Tensor, classes: list[str], k: int) -> list[list[str]]:
        """Per image: the class, its softmax probability, and the k most probable `class:probability`."""
        probs = logits.float().softmax(dim=1).cpu()
        values, index = probs.topk(max(1, min(k, len(classes))), dim=1)
        return [
            [classes[j[0]], f"{v[0]:.6f}", ";".join(f"{classes[a]}:{b:.6f}" for a, b in zip(j, v))]
            for v, j in zip(values.tolist(), index.tolist())
        ]


class Multilabel(Task):
    """Several labels per image: binary cross-entropy per class on the logits (task.loss), macro F1
    and micro F1 at `threshold`, mean average precision (val/mAP) and the exact-match ratio
    (val/accuracy: every label right). Targets are multi-hot vectors (goodput.recipe.datasets)."""

    def __init__(self, loss: nn.Module, threshold: float = 0.5):
        super().__init__(loss)
        if not 0.0 < threshold < 1.0:
            raise TaskError(f"task.threshold must be in (0, 1), got {threshold}")
        self.threshold = threshold

    def targets(self, batch: dict) -> torch.Tensor:
        return batch["label"].float()

    def soft(self, targets: torch.Tensor, num_classes: int) -> torch.Tensor:
        return targets

    def metric_modes(self, num_classes: int | None) -> dict[str, str]:
        return {"val/loss": "min", "val/accuracy": "max", "val/macro_f1": "max", "val/micro_f1": "max",
                "val/mAP": "max"}  # fmt: skip

    def metrics(self, classes: list[str], split: str = "val") -> MultilabelMetrics:
        return MultilabelMetrics(self, classes, self.threshold, split)

    def predict_header(self, k: int) -> list[str]:
        return ["path", "labels", f"top{k}"]

    def predict(self, logits: torch.Tensor, classes: list[str], k: int) -> list[list[str]]:
        """Per image: the labels whose sigmoid probability reaches the threshold (`;`-joined), and
        the k most probable `class:probability`."""
        probs = logits.float().sigmoid().cpu()
        values, index = probs.topk(max(1, min(k, len(classes))), dim=1)
        return [
            [";".join(c for c, q in zip(classes, p.tolist()) if q >= self.threshold),
             ";".join(f"{classes[a]}:{b:.6f}" for a, b in zip(j, v))]
            for p, v, j in zip(probs, values.tolist(), index.tolist())
        ]  # fmt: skip
