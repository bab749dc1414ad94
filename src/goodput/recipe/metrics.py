"""The state of one evaluation: sums that every rank adds its samples to, all-reduced once, then the
figures. A figure is a ratio of sums, so no sample counts twice or is lost and the numbers are the
same on 1 or N ranks (a loss up to float64 summation order; average precision from the scores of
every sample, gathered).

The protocol the engine (goodput.run.evaluate) and scripts/evaluate.py use:

    update(logits, targets, weights)   a batch (weights: 0 for padding and skipped files)
    reduce(world)                      collective: the sums of every rank
    compute() -> {name: value}         what MLflow logs (`<split>/...`); the task's metric_modes
                                       names the ones every evaluation has
    count, lines(), report(out_dir)    the number of samples, a printed table, files for MLflow
"""

from __future__ import annotations

import csv
import os
import re

import torch
import torch.distributed as dist


def metric_name(s: str) -> str:
    """MLflow takes letters, digits, _ - . / and space in a metric name: anything else becomes _."""
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", s)


def _all_reduce(world: int, *tensors: torch.Tensor) -> None:
    if world > 1:  # int64 and float64 apart: a count in float64 is exact only below 2**53
        for t in tensors:
            dist.all_reduce(t)


class ClassificationMetrics:
    """Loss, top-1, top-k and per-class accuracy from a confusion matrix (int64), the top-k hits
    (int64) and the summed loss (float64)."""

    def __init__(self, task, classes: list[str], top_k: int | None, split: str = "val"):
        self.task, self.classes, self.top_k, self.split = task, classes, top_k, split
        n = len(classes)
        self.confusion = torch.zeros(n * n, dtype=torch.int64)
        self.loss_sum = torch.zeros(1, dtype=torch.float64)
        self.hits = torch.zeros(1, dtype=torch.int64)

    def update(self, logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
        keep = w > 0
        logits, y = logits.float()[keep], y[keep]
        if not len(y):
            return
        n = len(self.classes)
        self.loss_sum += self.task.loss(logits, y).double().sum().cpu()
        pred = logits.argmax(1)
        self.confusion += torch.bincount((y * n + pred).cpu(), minlength=n * n)
        if self.top_k is not None:
            k = min(self.top_k, n)
            self.hits += (logits.topk(k, dim=1).indices == y[:, None]).any(1).sum().cpu()

    def reduce(self, world: int) -> None:
        _all_reduce(world, self.confusion, self.loss_sum, self.hits)

    @property
    def matrix(self) -> torch.Tensor:
        n = len(self.classes)
        return self.confusion.view(n, n)

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    def per_class(self) -> list[tuple[int, int, float]]:
        """(correct, samples, accuracy) per true class; accuracy is nan for a class the split lacks."""
        m = self.matrix
        out = []
        for c in range(len(self.classes)):
            n, ok = int(m[c].sum()), int(m[c, c])
            out.append((ok, n, ok / n if n else float("nan")))
        return out

    def compute(self) -> dict[str, float]:
        s, count = self.split, max(1, self.count)
        out = {f"{s}/loss": self.loss_sum.item() / count,
               f"{s}/accuracy": int(self.matrix.diagonal().sum()) / count}  # fmt: skip
        if self.top_k is not None:
            out[f"{s}/top{self.top_k}"] = int(self.hits.item()) / count
        for name, (_, n, acc) in zip(self.classes, self.per_class()):
            if n:
                out[f"{s}/class/{metric_name(name)}"] = acc
        return out

    def lines(self) -> list[str]:
        rows = [f"  {'class':<16} {'samples':>7} {'correct':>7} {'accuracy':>9}"]
        for name, (ok, n, acc) in zip(self.classes, self.per_class()):
            rows.append(f"  {name:<16} {n:>7} {ok:>7} {acc:>9.4f}")
        return rows

    def report(self, out_dir: str) -> list[str]:
        """per_class.csv and confusion_matrix.png in `out_dir`; returns their paths."""
        os.makedirs(out_dir, exist_ok=True)
        table = os.path.join(out_dir, "per_class.csv")
        with open(table, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["class", "label", "samples", "correct", "accuracy"])
            for i, (name, (ok, n, acc)) in enumerate(zip(self.classes, self.per_class())):
                w.writerow([name, i, n, ok, f"{acc:.6f}"])
        png = os.path.join(out_dir, "confusion_matrix.png")
        plot_confusion(self.matrix, self.classes, png, self.split)
        return [table, png]


class MultilabelMetrics:
    """Loss, exact-match ratio, macro and micro F1 at `threshold` from per-class counts (int64),
    and mean average precision over the classes that have a positive, from every sample's scores."""

    def __init__(self, task, classes: list[str], threshold: float, split: str = "val"):
        self.task, self.classes, self.threshold, self.split = task, classes, threshold, split
        n = len(classes)
        self.counts = torch.zeros(
            4, n, dtype=torch.int64
        )  # true positives, false pos., false neg., positives
        self.exact = torch.zeros(2, dtype=torch.int64)  # samples with every label right, samples
        self.loss_sum = torch.zeros(1, dtype=torch.float64)
        self.scores: list[torch.Tensor] = []  # [logit..., target..., weight] rows, padding included
        self.rows: torch.Tensor | None = None

    def update(self, logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
        logits, y = logits.float(), y.float()
        self.scores.append(torch.cat([logits, y, w[:, None].float()], 1).cpu())
        keep = w > 0
        logits, y = logits[keep], y[keep]
        if not len(y):
            return
        self.loss_sum += self.task.loss(logits, y).double().sum().cpu()
        pred, truth = logits.sigmoid() >= self.threshold, y >= 0.5
        self.counts += torch.stack(
            [(pred & truth).sum(0), (pred & ~truth).sum(0), (~pred & truth).sum(0), truth.sum(0)]
        ).cpu()
        self.exact += torch.tensor([int((pred == truth).all(1).sum()), len(y)])

    def reduce(self, world: int) -> None:
        _all_reduce(world, self.counts, self.exact, self.loss_sum)
        n = len(self.classes)
        mine = torch.cat(self.scores) if self.scores else torch.zeros(0, 2 * n + 1)
        if world > 1:  # every rank evaluates as many (padded) samples: equal shapes to gather
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            mine = torch.cat(parts)
        self.rows = mine[mine[:, -1] > 0]

    @property
    def count(self) -> int:
        return int(self.exact[1])

    def average_precision(self) -> list[float]:
        """AP per class (nan for a class without a positive): precision summed at each distinct
        score, weighted by the recall it adds; ties count together, so the order of samples (the
        world size) does not change it."""
        n = len(self.classes)
        rows = self.rows if self.rows is not None else torch.zeros(0, 2 * n + 1)
        out = []
        for c in range(n):
            s, t = rows[:, c].double(), (rows[:, n + c] >= 0.5).double()
            if t.sum() == 0:
                out.append(float("nan"))
                continue
            values, inverse = torch.unique(s, sorted=True, return_inverse=True)
            tp = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, t).flip(0).cumsum(0)
            seen = torch.bincount(inverse, minlength=len(values)).double().flip(0).cumsum(0)
            recall_gain = torch.diff(tp, prepend=tp.new_zeros(1)) / t.sum()
            out.append(float((recall_gain * tp / seen).sum()))
        return out

    def compute(self) -> dict[str, float]:
        s = self.split
        tp, fp, fn, pos = (self.counts[i].double() for i in range(4))
        f1 = 2 * tp / (2 * tp + fp + fn).clamp(min=1)
        ap = [a for a in self.average_precision() if a == a]
        micro = 2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp(min=1)
        out = {f"{s}/loss": self.loss_sum.item() / max(1, self.count),
               f"{s}/accuracy": int(self.exact[0]) / max(1, self.count),
               f"{s}/macro_f1": float(f1.mean()), f"{s}/micro_f1": float(micro),
               f"{s}/mAP": sum(ap) / len(ap) if ap else float("nan")}  # fmt: skip
        for name, v in zip(self.classes, f1.tolist()):
            out[f"{s}/class/{metric_name(name)}"] = v
        return out

    def lines(self) -> list[str]:
        rows = [f"  {'class':<16} {'positives':>9} {'f1':>7} {'AP':>7}"]
        f1 = self.compute()
        for i, (name, ap) in enumerate(zip(self.classes, self.average_precision())):
            v = f1[f"{self.split}/class/{metric_name(name)}"]
            rows.append(f"  {name:<16} {int(self.counts[3, i]):>9} {v:>7.4f} {ap:>7.4f}")
        return rows

    def report(self, out_dir: str) -> list[str]:
        """per_class.csv (positives, true/false positives, false negatives, F1, AP) in `out_dir`."""
        os.makedirs(out_dir, exist_ok=True)
        table = os.path.join(out_dir, "per_class.csv")
        tp, fp, fn, pos = self.counts.tolist()
        with open(table, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["class", "label", "positives", "true_pos", "false_pos", "false_neg", "f1", "ap"])
            for i, (name, ap) in enumerate(zip(self.classes, self.average_precision())):
                f1 = 2 * tp[i] / max(1, 2 * tp[i] + fp[i] + fn[i])
                w.writerow([name, i, pos[i], tp[i], fp[i], fn[i], f"{f1:.6f}", f"{ap:.6f}"])
        return [table]


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
