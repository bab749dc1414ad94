"""Evaluation: the task's figures against hand-computed cases (classification, multilabel), and the
same numbers on 1 and 2 ranks."""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import pytest
import torch
from helpers import end_gloo_rank
from torch import nn

from goodput.data.config import DataConfig
from goodput.data.loader import eval_loader, frozen_for_fork
from goodput.data.synthetic import make_dataset
from goodput.model import SmallCNN
from goodput.recipe.task import Classification, Multilabel
from goodput.run.evaluate import evaluate
from goodput.storage.remote import Storage

# Six samples, four classes: each row is one sample's logits, the label beside it.
LOGITS = [
    ([4.0, 1.0, 0.0, 0.0], 0),  # top-1 right
    ([1.0, 3.0, 2.0, 0.0], 2),  # wrong, 2nd best: a top-2 hit
    ([0.0, 1.0, 2.0, 3.0], 0),  # wrong, last: no top-2 hit
    ([0.0, 5.0, 0.0, 0.0], 1),  # right
    ([2.0, 0.0, 1.0, 0.0], 2),  # wrong, 2nd best: top-2 hit
    ([0.0, 0.0, 0.0, 9.0], 3),  # right
]


class Table(nn.Module):
    """The 'model' of the hand-computed case: input i (a float holding the index) -> row i of LOGITS."""

    def __init__(self):
        super().__init__()
        self.rows = nn.Parameter(torch.tensor([r for r, _ in LOGITS]), requires_grad=False)

    def forward(self, x):
        return self.rows[x.view(-1).long()]


def classification(top_k=None, **loss) -> Classification:
    return Classification(nn.CrossEntropyLoss(**loss), top_k=top_k)


def batch(images, labels, index=None, ok=None) -> dict:
    n = len(images)
    index = torch.arange(n) if index is None else torch.tensor(index)
    ok = torch.ones(n, dtype=torch.int64) if ok is None else torch.tensor(ok)
    return {"image": images, "label": labels, "index": index, "ok": ok}


def test_figures_match_a_hand_computed_case():
    idx = torch.arange(len(LOGITS), dtype=torch.float32)
    labels = torch.tensor([y for _, y in LOGITS])
    # two batches, the second padded (index -1, what eval_loader does on short ranks) with labels that
    # would count as right if the padding were not weighed zero
    batches = [
        batch(idx[:4], labels[:4]),
        batch(torch.cat([idx[4:], torch.tensor([0.0, 3.0])]), torch.cat([labels[4:], torch.tensor([0, 3])]),
              index=[4, 5, -1, -1]),
    ]  # fmt: skip
    ev = evaluate(Table(), batches, torch.device("cpu"), 1, classification(2).metrics(list("abcd")))
    assert ev.count == 6
    m = ev.compute()
    assert m["val/accuracy"] == 3 / 6  # samples 0, 3, 5
    assert m["val/top2"] == 5 / 6  # all but sample 2
    # per class: a = samples 0 (right), 2 (wrong); b = 3 (right); c = 1, 4 (both wrong); d = 5 (right)
    assert (m["val/class/a"], m["val/class/b"], m["val/class/c"], m["val/class/d"]) == (0.5, 1.0, 0.0, 1.0)
    want_loss = sum(math.log(sum(math.exp(v) for v in r)) - r[y] for r, y in LOGITS) / 6
    assert m["val/loss"] == pytest.approx(want_loss, rel=1e-6)
    assert ev.matrix.tolist() == [[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]]


def test_val_loss_is_the_tasks_loss():
    """val/loss is computed with task.loss: label smoothing shows in it (cross-entropy is written once)."""
    images, labels = torch.arange(6.0), torch.tensor([y for _, y in LOGITS])
    plain = evaluate(
        Table(), [batch(images, labels)], torch.device("cpu"), 1, classification().metrics(list("abcd"))
    )
    smooth = classification(label_smoothing=0.2).metrics(list("abcd"))
    smooth = evaluate(Table(), [batch(images, labels)], torch.device("cpu"), 1, smooth)
    logits = torch.tensor([r for r, _ in LOGITS])
    want = nn.functional.cross_entropy(logits, labels, label_smoothing=0.2).item()
    assert smooth.compute()["val/loss"] == pytest.approx(want, rel=1e-6)
    assert plain.compute()["val/loss"] != pytest.approx(want, rel=1e-3)
    assert plain.compute()["val/accuracy"] == smooth.compute()["val/accuracy"]


def test_top_k_default_and_report(tmp_path):
    assert classification().top(10) == 5 and classification().top(4) is None and classification(3).top(4) == 3
    ev = evaluate(
        Table(), [batch(torch.arange(6.0), torch.tensor([y for _, y in LOGITS]))],
        torch.device("cpu"), 1, classification().metrics(list("abcd")),
    )  # fmt: skip
    assert not any(k.startswith("val/top") for k in ev.compute())
    table, png = ev.report(str(tmp_path))
    with open(table) as f:
        rows = f.read().splitlines()
    assert rows[0] == "class,label,samples,correct,accuracy" and rows[3] == "c,2,2,0,0.000000"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# -- 1 rank vs 2 ranks on a val set of odd size ------------------------------------------------
def _data(root: str) -> DataConfig:
    return DataConfig(
        source={"_target_": "goodput.data.sources.RemoteSource"}, root=root,
        cache_dir=os.path.join(root, "c"), image_size=16, num_workers=0,
    )  # fmt: skip


def _rank(rank: int, world: int, root: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    torch.manual_seed(0)
    model = SmallCNN(3, width=8)
    loader = eval_loader(_data(root), Storage(root), 2, rank, world, torch.device("cpu"))
    ev = evaluate(model, loader, torch.device("cpu"), world, classification(2).metrics(list("abc")))
    if rank == 0:
        torch.save({"confusion": ev.matrix, "loss": ev.compute()["val/loss"], "hits": int(ev.hits)}, out)
    if world > 1:
        end_gloo_rank()


def _run(world: int, root: str, out: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # no new interpreter: the children share the imported modules
    procs = [ctx.Process(target=_rank, args=(r, world, root, port, out)) for r in range(world)]
    with frozen_for_fork():  # the parent's uncollected objects are not the children's to finalize
        for p in procs:
            p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    return torch.load(out)


def test_same_figures_on_one_and_two_ranks_with_an_odd_val_set(tmp_path):
    root = str(tmp_path / "data")
    make_dataset(root, num_classes=3, train_per_class=2, val_per_class=3, image_size=16, seed=1)
    # the reference: every val sample once, in one batch, no loader
    loader = eval_loader(_data(root), Storage(root), 64, 0, 1, torch.device("cpu"))
    batch = next(iter(loader))
    assert len(batch["label"]) == 9  # odd: two ranks get 5 and 4 (+1 pad)
    torch.manual_seed(0)
    with torch.no_grad():
        logits = SmallCNN(3, width=8).eval()(batch["image"])
    want = torch.zeros(3, 3, dtype=torch.int64)
    for y, p in zip(batch["label"].tolist(), logits.argmax(1).tolist()):
        want[y, p] += 1
    one = _run(1, root, str(tmp_path / "one.pt"))
    two = _run(2, root, str(tmp_path / "two.pt"))
    assert torch.equal(one["confusion"], want) and torch.equal(two["confusion"], want)
    assert (
        one["hits"] == two["hits"] == int((logits.topk(2, 1).indices == batch["label"][:, None]).any(1).sum())
    )
    want_loss = torch.nn.functional.cross_entropy(logits, batch["label"]).item()
    # the loss is a float32 computation: another batch split moves its last bits, not more
    assert one["loss"] == pytest.approx(want_loss, rel=1e-6)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)


# -- multilabel -----------------------------------------------------------------------------------
# Four samples, three classes: logits (sigmoid >= 0.5 <=> logit >= 0) and multi-hot targets.
ML_LOGITS = [[2.0, -1.0, 0.5], [-3.0, 1.0, -0.2], [0.1, 0.3, -2.0], [-1.0, -2.0, 3.0]]
ML_TARGETS = [[1, 0, 1], [0, 1, 0], [0, 1, 1], [0, 0, 1]]


def multilabel_case(pad: bool):
    logits, targets = torch.tensor(ML_LOGITS), torch.tensor(ML_TARGETS, dtype=torch.float32)
    index = list(range(4))
    if pad:  # padding that predicts every label right would raise every figure if it counted
        logits, targets = torch.cat([logits, torch.ones(1, 3)]), torch.cat([targets, torch.ones(1, 3)])
        index.append(-1)

    class Rows(nn.Module):
        def forward(self, x):
            return logits[x.long()]

    return Rows(), [batch(torch.arange(float(len(index))), targets, index=index)]


def test_multilabel_figures_match_a_hand_computed_case():
    task = Multilabel(nn.BCEWithLogitsLoss())
    model, batches = multilabel_case(pad=True)
    m = evaluate(model, batches, torch.device("cpu"), 1, task.metrics(list("abc"))).compute()
    # predicted (logit >= 0): [1,0,1], [0,1,0], [1,1,0], [0,0,1] -> rows 0, 1, 3 exactly right
    assert m["val/accuracy"] == 3 / 4
    # per class tp/fp/fn: a 1/1/0, b 2/0/0, c 2/0/1 -> F1 2/3, 1, 4/5
    assert m["val/class/a"] == pytest.approx(2 / 3) and m["val/class/b"] == 1.0
    assert m["val/class/c"] == pytest.approx(4 / 5)
    assert m["val/macro_f1"] == pytest.approx((2 / 3 + 1 + 4 / 5) / 3)
    assert m["val/micro_f1"] == pytest.approx(2 * 5 / (2 * 5 + 1 + 1))
    # AP: a: one positive, ranked 1st of 4 -> 1; b: positives ranked 1st and 2nd -> 1;
    # c: scores 3.0 (+), 0.5 (+), -0.2, -2.0 (+) -> (1 + 1 + 3/4) / 3
    assert m["val/mAP"] == pytest.approx((1 + 1 + (1 + 1 + 3 / 4) / 3) / 3)
    want = nn.functional.binary_cross_entropy_with_logits(torch.tensor(ML_LOGITS), torch.tensor(
        ML_TARGETS, dtype=torch.float32)).item()  # fmt: skip
    assert m["val/loss"] == pytest.approx(want, rel=1e-6)


def test_multilabel_average_precision_counts_ties_together():
    """Equal scores are one threshold: the order the samples arrive in (the world size) cannot change AP."""
    task = Multilabel(nn.BCEWithLogitsLoss())
    aps = []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        logits = torch.tensor([[1.0], [1.0], [1.0], [0.0]])[order]
        targets = torch.tensor([[1.0], [0.0], [0.0], [1.0]])[order]
        ev = task.metrics(["a"])
        ev.update(logits, targets, torch.ones(4))
        ev.reduce(1)
        aps.append(ev.compute()["val/mAP"])
    assert aps[0] == aps[1] == pytest.approx((1 / 3) * 0.5 + (2 / 4) * 0.5)
