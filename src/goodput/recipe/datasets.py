"""Dataset classes of your own: what a split holds (`data.dataset._target_`).

A dataset class is called with the data root's storage, the split (`train`, `val`, `test`), the
node cache dir and the `data.dataset` node's other keys, and sets (through `_index`) `files` (paths
under the root, in a fixed order: sample i is files[i], which the order, the augmentation seeds and
checkpoints refer to), `labels`, `sizes` (bytes) and `classes`; `target(i)` is sample i's label as
the task takes it and `blank_target()` the label of a sample that is not there. Subclass
goodput.data.dataset.ImageFolder (`<split>/<class>/<image>`) or CsvManifest (`<split>.csv`).
"""

from __future__ import annotations

import torch

from goodput.data.dataset import CsvManifest


class MultilabelManifest(CsvManifest):
    """`<root>/<split>.csv` rows of `path,labels`, the labels class names joined by `;`. Targets are
    multi-hot vectors over the sorted class names (task=multilabel). The demo data of
    `demo_data.kind=multilabel` is written this way."""

    separator = ";"

    def target(self, index: int) -> torch.Tensor:
        hot = torch.zeros(len(self.classes))
        hot[self.labels[index]] = 1.0
        return hot

    def blank_target(self) -> torch.Tensor:
        return torch.zeros(len(self.classes))
