"""Validation: loss, top-1, top-k and per-class accuracy from one pass over val/, exact on any world size.

Each rank evaluates its disjoint slice of val/ (goodput.data.loader.eval_loader: rank r takes
samples r, r+W, r+2W, ...; the short ranks are padded with label -1, which is masked here), and
the ranks sum *counts*: a confusion matrix (int64), the top-k hits (int64) and the summed loss
(float64). Every figure is a ratio of those sums, so no sample is counted twice or dropped and the
accuracies are the same numbers on 1 or N ranks (the loss up to float64 summation order).
"""

from __future__ import annotations

import csv
import logging
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

log = logging.getLogger(__name__)


def default_top_k(top_k: int | None, num_classes: int) -> int | None:
    """trainer.eval_top_k: null = 5 when there are at least 5 classes (else no top-k metric)."""
    if top_k is None:
        return 5 if num_classes >= 5 else None
    return top_k


@dataclass
class Evaluation:
    """The summed counts of one evaluation (identical on every rank after the all-reduce)."""

    confusion: torch.Tensor  # [true class, predicted class] counts, int64
    loss_sum: float
    top_k: int | None
    top_k_hits: int

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.count)

    @property
    def accuracy(self) -> float:
        return int(self.confusion.diagonal().sum()) / max(1, self.count)

    def per_class(self) -> list[tuple[int, int, float]]:
        """(correct, samples, accuracy) per true class; accuracy is nan for a class val/ lacks."""
        out = []
        for c in range(self.confusion.shape[0]):
            n, ok = int(self.confusion[c].sum()), int(self.confusion[c, c])
            out.append((ok, n, ok / n if n else float("nan")))
        return out

    def metrics(self, classes: list[str], split: str = "val") -> dict[str, float]:
        """The MLflow metrics: val/loss, val/accuracy, val/top<k>, val/class/<name> (`split`/... for
        another split: scripts/evaluate.py --split test)."""
        m = {f"{split}/loss": self.loss, f"{split}/accuracy": self.accuracy}
        if self.top_k is not None:
            m[f"{split}/top{self.top_k}"] = self.top_k_hits / max(1, self.count)
        for name, (_, n, acc) in zip(classes, self.per_class()):
            if n:
                m[f"{split}/class/{metric_name(name)}"] = acc
        return m


def metric_name(s: str) -> str:
    """MLflow takes letters, digits, _ - . / and space in a metric name: anything else becomes _."""
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", s)


@torch.no_grad()
def evaluate(model, loader, device, world: int, num_classes: int, top_k: int | None) -> Evaluation:
    """One pass over this rank's val slice, then one all-reduce of the counts (collective)."""
    was_training = model.training
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64)
    loss_sum = torch.zeros(1, dtype=torch.float64)
    hits = torch.zeros(1, dtype=torch.int64)
    for batch in loader:
        x, y = batch["image"].to(device, non_blocking=True), batch["label"].to(device)
        logits = model(x).float()
        keep = y >= 0  # -1 pads the short ranks (and marks no sample of val/)
        logits, y = logits[keep], y[keep]
        if not len(y):
            continue
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double().cpu()
        pred = logits.argmax(1)
        confusion += torch.bincount((y * num_classes + pred).cpu(), minlength=num_classes * num_classes)
        if top_k is not None:
            k = min(top_k, num_classes)
            hits += (logits.topk(k, dim=1).indices == y[:, None]).any(1).sum().cpu()
    if world > 1:
        # float64 and int64 travel apart: an int count in a float64 buffer is exact only below 2**53,
        # and an all-reduce in one dtype keeps the code short without that caveat.
        dist.all_reduce(confusion)
        dist.all_reduce(loss_sum)
        dist.all_reduce(hits)
    if was_training:
        model.train()
    return Evaluation(confusion.view(num_classes, num_classes), loss_sum.item(), top_k, int(hits.item()))


def write_report(ev: Evaluation, classes: list[str], out_dir: str, split: str = "val") -> list[str]:
    """The final evaluation (of `split`) as files: per_class.csv and confusion_matrix.png. Returns
    their paths."""
    os.makedirs(out_dir, exist_ok=True)
    table = os.path.join(out_dir, "per_class.csv")
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "label", "samples", "correct", "accuracy"])
        for i, (name, (ok, n, acc)) in enumerate(zip(classes, ev.per_class())):
            w.writerow([name, i, n, ok, f"{acc:.6f}"])
    png = os.path.join(out_dir, "confusion_matrix.png")
    plot_confusion(ev.confusion, classes, png, split)
    return [table, png]


def plot_confusion(confusion: torch.Tensor, classes: list[str], path: str, split: str = "val") -> None:
    """Row-normalised confusion matrix (each true class sums to 1), with the counts written in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = confusion.double()
    norm = (c / c.sum(1, keepdim=True).clamp(min=1)).numpy()
    n = len(classes)
    size = min(12.0, 2.0 + 0.45 * n)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), classes, rotation=90, fontsize=7)
    ax.set_yticks(range(n), classes, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if n <= 30:  # beyond that the numbers are unreadable anyway
        for i in range(n):
            for j in range(n):
                if confusion[i, j]:
                    color = "white" if norm[i, j] > 0.5 else "black"
                    ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=6, color=color)
    acc = float(c.diagonal().sum() / c.sum().clamp(min=1))
    name = {"val": "validation", "test": "test"}.get(split, split)
    ax.set_title(f"{name} confusion matrix (accuracy {acc:.3f}, {int(c.sum())} samples)")
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)
