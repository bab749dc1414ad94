"""Using a trained model, in-process: the model record read as untrusted input, warm starts
(run.init_from) through the resume seam, the test split, and the images prediction reads."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from helpers import compose_train, manager

from goodput.checkpoint import AppState
from goodput.checkpoint.export import SourceError, read_weights, save_safetensors
from goodput.checkpoint.resume import InitFromError, init_from
from goodput.checkpoint.spec import ModelSpec, SpecError
from goodput.data.dataset import decode as training_decode
from goodput.data.synthetic import make_dataset
from goodput.inference import InputError, Loaded, decode, evaluation_loader, image_files
from goodput.model import SmallCNN
from goodput.storage.remote import Storage

CLASSES = ["cross", "disc", "square", "triangle"]  # the first 4 shapes of the demo data


def record(**change) -> dict:
    node = {"_target_": "goodput.model.SmallCNN", "width": 8}
    return {
        "node": node,
        "classes": CLASSES,
        "image_size": 16,
        "mean": [0.5] * 3,
        "std": [0.25] * 3,
        **change,
    }


# -- the model record ---------------------------------------------------------------------------
def test_a_good_record_builds_its_model_and_the_eval_view():
    spec = ModelSpec.parse(json.loads(json.dumps(record())), "COMMIT.json")
    model = spec.build()
    assert (
        isinstance(model, SmallCNN) and model.head.out_features == 4 and model.blocks[0][0].out_channels == 8
    )
    x = spec.transform()(torch.full((3, 40, 24), 255, dtype=torch.uint8))
    assert x.shape == (3, 16, 16) and torch.allclose(x, torch.full_like(x, (1 - 0.5) / 0.25))
    # a torchvision builder is a function: allowed; `weights` named by a record is never downloaded
    rn = ModelSpec.parse(
        record(node={"_target_": "torchvision.models.resnet18", "weights": "IMAGENET1K_V1"}), "x"
    )
    assert rn.build().fc.out_features == 4  # (with weights="IMAGENET1K_V1" it would download them)


def test_the_nested_model_form_a_run_trains_is_rebuilt_from_its_record(tmp_path, one_process):
    """`model: {_target_: ..., net: {_target_: ...}}` trains, and evaluate/predict rebuild it from the
    commit record (every nested `_target_` checked as the top one is); the task comes back too."""
    from helpers import run_job_here

    from goodput.inference import load, predict

    small = "{_target_:goodput.recipe.models.SmallCNN,num_classes:5,width:8}"
    net = f"+model={{_target_:helpers.WithHead,net:{small}}}"
    summary, _ = run_job_here(tmp_path, "~model", net, "trainer.max_steps=2")
    loaded = load(summary["checkpoint_dir"])
    assert type(loaded.model).__name__ == "WithHead" and loaded.model.out.out_features == 10
    assert loaded.sha256 == summary["model_sha256"]
    images = sorted((tmp_path / "remote" / "data").glob("shapes-*/val/disc/*.jpg"))[:2]
    rows = list(predict(loaded, [str(p) for p in images]))
    assert rows[0] == ["path", "class", "probability", "top5"] and len(rows) == 3
    assert type(loaded.spec.build_task()).__name__ == "Classification"


# The jobs in this process (one_process) run before the tests below make the module's one-process
# group (dist1): a job makes its own, and a second default group cannot be made beside it.
def test_predict_and_evaluate_normalize_as_the_record_says(tmp_path, one_process):
    """A run trained with ImageNet's mean and std (every other record in the suite has the defaults,
    where normalizing with the defaults instead of the record's values is invisible): predict.py's
    probabilities and evaluate.py's loss are the checkpoint's weights applied to that eval view,
    computed here with torchvision from the values the run was given."""
    import runpy

    import torch.nn.functional as F
    from helpers import REPO, final_weights, run_job_here
    from torchvision.transforms import v2

    from goodput.data.dataset import ImageFolder

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    summary, c = run_job_here(tmp_path, f"augment.mean={mean}", f"augment.std={std}", "trainer.max_steps=2")
    src = summary["checkpoint_dir"]
    model = SmallCNN(num_classes=10, width=32)
    model.load_state_dict(final_weights(src))
    scaled = v2.ToDtype(torch.float32, scale=True)
    view = v2.Compose([v2.Resize(16, antialias=True), v2.CenterCrop(16), scaled, v2.Normalize(mean, std)])
    val = ImageFolder(Storage(c.data.root), "val")
    files = [os.path.join(c.data.root, f) for f in val.files]
    with torch.no_grad():
        logits = model.eval()(torch.stack([view(decode(f)) for f in files]))
    probs = logits.softmax(dim=1)

    out = tmp_path / "predictions.csv"
    predict_main = runpy.run_path(str(REPO / "scripts" / "predict.py"))["main"]
    with redirect_stderr(io.StringIO()):
        assert predict_main([src, *files, "--out", str(out), "--top-k", "10"]) == 0
    with open(out) as f:
        rows = list(csv.reader(f))[1:]
    assert [r[0] for r in rows] == files
    for row, p in zip(rows, probs):
        shown = dict(pair.split(":") for pair in row[3].split(";"))  # every class: --top-k 10
        got = torch.tensor([float(shown[k]) for k in val.classes])
        assert torch.allclose(got, p, atol=2e-6), (row[0], (got - p).abs().max().item())

    evaluate_main = runpy.run_path(str(REPO / "scripts" / "evaluate.py"))["main"]
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert evaluate_main([src, "--no-mlflow", "--json"]) == 0
    metrics = json.loads(printed.getvalue())
    labels = torch.tensor(val.labels)
    assert metrics["samples"] == len(files)
    assert math.isclose(metrics["val/loss"], F.cross_entropy(logits, labels).item(), rel_tol=1e-6)
    assert metrics["val/accuracy"] == (logits.argmax(1) == labels).sum().item() / len(files)


def test_a_warm_started_run_resumes_its_own_commit_with_the_source_still_there(tmp_path, one_process):
    """The job (worker and resume seam) applies run.init_from only to a fresh start. Relaunched
    after a failure at step 7 with the source still readable (loading it again would go through
    without an error), the run resumes its own step-4 commit and ends on the uninterrupted
    warm-started run's model."""
    from helpers import run_job_here

    from goodput.resilience.fault import InjectedFailure

    src, _ = run_job_here(tmp_path, "trainer.max_steps=2")  # one paths.root: one demo data, one store
    warm = [f"run.init_from={src['checkpoint_dir']}", "checkpoint.rescue=false"]
    ref, _ = run_job_here(tmp_path, *warm, "run.name=ref")
    with pytest.raises(InjectedFailure):
        run_job_here(tmp_path, *warm, "run.name=warm", "fault.raise_at_step=7")
    assert os.path.isdir(src["checkpoint_dir"])
    s, _ = run_job_here(tmp_path, *warm, "run.name=warm", "fault.raise_at_step=7")
    assert s["resumed_from_steps"] == [4] and s["model_sha256"] == ref["model_sha256"]


def test_a_hostile_task_record_is_refused():
    cls = "goodput.recipe.task.Classification"
    for task, message in [
        ({"_target_": "os.system", "command": "true"}, "is not a goodput.recipe.task.Task"),
        ({"_target_": cls, "loss": {"_target_": "os.system"}}, "'os.system' is neither"),
        ({"_target_": cls, "loss": {"_target_": "torch.nn.L1Loss", "_args_": [1]}}, "loss._args_ is refused"),
    ]:  # fmt: skip
        with pytest.raises(SpecError, match=message):
            ModelSpec.parse(record(task=task), "COMMIT.json").build_task()
    spec = ModelSpec.parse(record(), "COMMIT.json")  # a record from before the task seam
    assert spec.task is None and type(spec.build_task()).__name__ == "Classification"


@pytest.mark.parametrize(
    "node",
    [
        # a detection or segmentation builder defaults weights_backbone to ImageNet's
        {"_target_": "torchvision.models.segmentation.fcn_resnet50"},
        {"_target_": "torchvision.models.segmentation.fcn_resnet50", "weights_backbone": "DEFAULT"},
        {"_target_": "torchvision.models.detection.ssdlite320_mobilenet_v3_large"},
    ],
)
def test_a_record_never_makes_torchvision_download(node, tmp_path, monkeypatch):
    import torch.hub

    def refuse(url, *a, **k):
        raise AssertionError(f"downloaded {url}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # nothing cached: a load would be a download
    assert isinstance(ModelSpec.parse(record(node=node), "x").build(), torch.nn.Module)


@pytest.mark.parametrize("key", ["pretrained", "pretrained_backbone"])
def test_a_record_asking_for_pretrained_weights_is_refused(key):
    spec = ModelSpec.parse(record(node={"_target_": "torchvision.models.resnet18", key: True}), "x")
    with pytest.raises(SpecError, match=f"{key} refused"):
        spec.build()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"node": {"_target_": "os.system", "command": "touch {tmp}/pwned"}}, "neither an nn.Module class"),
        ({"node": {"_target_": "builtins.eval", "source": "1"}}, "neither an nn.Module class"),
        ({"node": {"_target_": "subprocess.Popen", "args": "true"}}, "neither an nn.Module class"),  # a class
        (
            {"node": {"_target_": "goodput.data.synthetic.make_dataset", "root": "/tmp/x"}},
            "neither an nn.Module",
        ),
        (
            {"node": {"_target_": "goodput.model.SmallCNN", "x": {"_target_": "os.system"}}},
            "'os.system' is neither",
        ),
        (
            {
                "node": {
                    "_target_": "goodput.model.SmallCNN",
                    "x": {"_target_": "torch.nn.ReLU", "_args_": [1]},
                }
            },
            "key x._args_ is refused",
        ),  # fmt: skip
        ({"node": {"_target_": "goodput.model.SmallCNN", "_args_": ["rm"]}}, "key _args_ is refused"),
        ({"node": {"_target_": "goodput.model.SmallCNN", "_partial_": True}}, "key _partial_ is refused"),
        ({"node": {"_target_": "not a name"}}, "not a dotted name"),
        ({"node": "goodput.model.SmallCNN"}, "must be an object with a _target_"),
        ({"classes": []}, "classes must be a non-empty list"),
        ({"classes": ["a", "a"]}, "class names repeat"),
        ({"image_size": True}, "image_size must be an integer"),
        ({"image_size": 10**9}, "image_size must be an integer"),
        ({"mean": [0.5, 0.5]}, "mean must be 3 numbers"),
        ({"std": [0.25, 0.0, 0.25]}, "std must be positive"),
        ({"std": [float("nan")] * 3}, "std must be 3 numbers"),
    ],
)
def test_a_hostile_or_malformed_record_is_refused_naming_the_field(change, message, tmp_path):
    """Whoever writes the store writes the record: nothing it names is called unless it is a model
    (planted without the check, make_dataset wrote a dataset where the record said)."""
    change = json.loads(json.dumps(change).replace("{tmp}", str(tmp_path)))
    with pytest.raises(SpecError, match=message):
        ModelSpec.parse(record(**change), "COMMIT.json").build()
    assert not os.path.exists(tmp_path / "pwned")


def test_a_record_missing_or_not_an_object():
    with pytest.raises(SpecError, match="has no model record"):
        ModelSpec.parse(None, "step-000000004")
    with pytest.raises(SpecError, match="carries no model record"):
        ModelSpec.from_metadata({"step": "4"}, "m.safetensors")
    with pytest.raises(SpecError, match="not an object"):
        ModelSpec.parse([1], "x")


# -- warm start ---------------------------------------------------------------------------------
def fresh_app(seed: int, width: int = 8, num_classes: int = 4, ema: bool = False):
    """A new run's state: a model of its own seed, a fresh optimizer and schedule (no step taken)."""
    from goodput.run.step import make_ema

    torch.manual_seed(seed)
    model = SmallCNN(num_classes=num_classes, width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    app = AppState(model, opt, rank=0)
    app.register("scheduler", sched)
    if ema:
        app.register_module("ema", make_ema(model, 0.5))
    return app, sched


def source_run(tmp_path, dist1, with_record: bool = True):
    """A committed step 7 of a trained run (one real step), and its model."""
    from helpers import make_app

    mgr = manager(tmp_path, "dcp_sync", dist1)
    if with_record:
        mgr.commit_info["model"] = record()
    app, *_ = make_app(1)
    mgr.save(7, app)
    mgr.wait()
    mgr.close()
    return str(tmp_path / "remote"), app.model


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_loads_the_source_weights_and_leaves_the_rest_fresh(tmp_path, dist1):
    src, trained = source_run(tmp_path / "src", dist1)
    mgr = manager(tmp_path / "new", "dcp_sync", dist1)
    app, sched = fresh_app(2, ema=True)
    assert not same(app.model.state_dict(), trained.state_dict())
    got = init_from(mgr, app, None, src, CLASSES, Storage)
    assert got.step == 7
    assert same(app.model.state_dict(), trained.state_dict())  # the weights, tensor for tensor
    assert same(app.modules["ema"].module.state_dict(), trained.state_dict())  # the EMA starts there too
    assert app.optimizer.state_dict()["state"] == {} and sched.last_epoch == 0  # nothing else came along
    # a step dir and a safetensors export of it are sources too
    for source in (f"{src}/step-000000007", str(tmp_path / "m.safetensors")):
        save_safetensors(
            trained.state_dict(), str(tmp_path / "m.safetensors"), ModelSpec.parse(record(), "x").metadata()
        )
        app2, _ = fresh_app(3)
        init_from(mgr, app2, None, source, CLASSES, Storage)
        assert same(app2.model.state_dict(), trained.state_dict()), source
    mgr.close()


def test_init_from_is_not_applied_when_the_run_resumed_its_own_checkpoint(tmp_path, dist1, caplog):
    src, trained = source_run(tmp_path / "src", dist1)
    mgr = manager(tmp_path / "new", "dcp_sync", dist1)
    own, _ = fresh_app(5)
    mgr.save(4, own)
    mgr.wait()
    app, _ = fresh_app(6)
    rec, _ = mgr.restore(app, mgr.committed())  # what resume() does on a relaunch
    with caplog.at_level(logging.INFO, logger="goodput.checkpoint.resume"):
        assert init_from(mgr, app, rec, src, CLASSES, Storage) is None
    assert same(app.model.state_dict(), own.model.state_dict())  # its own step 4, not the source
    assert "not applied: this run resumed its own checkpoint (step 4)" in caplog.text
    mgr.close()


def test_init_from_other_class_names_of_the_same_number_train_on_with_a_warning(tmp_path, dist1, caplog):
    src, trained = source_run(tmp_path / "src", dist1)
    mgr = manager(tmp_path / "new", "dcp_sync", dist1)
    app, _ = fresh_app(2)
    others = ["a", "b", "c", "d"]
    with caplog.at_level(logging.WARNING, logger="goodput.checkpoint.resume"):
        init_from(mgr, app, None, src, others, Storage)
    assert same(app.model.state_dict(), trained.state_dict())
    assert (
        "was trained on classes ['cross', 'disc', 'square', 'triangle'], this run's are ['a', 'b'"
        in caplog.text
    )
    mgr.close()


def test_init_from_refuses_weights_that_do_not_fit(tmp_path, dist1):
    src, _ = source_run(tmp_path / "src", dist1)
    mgr = manager(tmp_path / "new", "dcp_sync", dist1)
    with pytest.raises(
        InitFromError, match=r"shapes differ .*blocks\.0\.0\.weight \(8, 3, 3, 3\) vs \(16, 3, 3, 3\)"
    ) as e:
        node = {**record()["node"], "width": 16}  # the worker passes the run's own model node
        init_from(mgr, fresh_app(2, width=16)[0], None, src, CLASSES, Storage, node)
    assert f"its model record ({src}/step-000000007) differs: width 8 (this run: 16)" in str(e.value)
    six = [*CLASSES, "dots", "ring"]
    with pytest.raises(InitFromError, match=r"has 4 classes \['cross', .*this run's data has 6 \['cross'"):
        init_from(mgr, fresh_app(2, num_classes=6)[0], None, src, six, Storage)
    # without a record (an export of an older goodput), the shapes say it
    bare = tmp_path / "bare.safetensors"
    save_safetensors(SmallCNN(4, 8).state_dict(), str(bare))
    with pytest.raises(InitFromError, match="head.weight .*this run has 6 classes: another num_classes"):
        init_from(mgr, fresh_app(2, num_classes=6)[0], None, str(bare), six, Storage)
    extra = {**SmallCNN(4, 8).state_dict(), "extra.weight": torch.zeros(1)}
    save_safetensors(extra, str(bare))
    with pytest.raises(InitFromError, match=r"unexpected \['extra.weight'\]"):
        init_from(mgr, fresh_app(2)[0], None, str(bare), CLASSES, Storage)
    with pytest.raises(InitFromError, match="no such directory"):
        init_from(mgr, fresh_app(2)[0], None, str(tmp_path / "nothing"), CLASSES, Storage)
    mgr.close()


def test_a_source_is_checked_before_any_work(tmp_path, dist1):
    """What the job checks before a fresh start (goodput.run.job): the source is there."""
    src, _ = source_run(tmp_path / "src", dist1)
    with pytest.raises(
        SourceError, match=r"step-000000009: not a committed checkpoint \(committed steps: \[7\]\)"
    ):
        read_weights(f"{src}/step-000000009")
    with pytest.raises(SourceError, match="no committed checkpoint"):
        read_weights(str(tmp_path))
    with pytest.raises(SourceError, match="no such safetensors file"):
        read_weights(str(tmp_path / "x.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(SourceError, match="not a readable safetensors file"):
        read_weights(str(tmp_path / "junk.safetensors"))


# -- the test split -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def with_test(tmp_path_factory):
    root = tmp_path_factory.mktemp("with-test")
    n = make_dataset(
        str(root), num_classes=4, train_per_class=4, val_per_class=2, image_size=16, test_per_class=3
    )
    return str(root), n


def test_make_dataset_writes_a_test_split_only_when_asked(with_test, tmp_path):
    root, n = with_test
    assert n["test"] == 12 and sorted(os.listdir(f"{root}/test")) == sorted(os.listdir(f"{root}/train"))
    plain = make_dataset(
        str(tmp_path / "plain"), num_classes=4, train_per_class=4, val_per_class=2, image_size=16
    )
    assert "test" not in plain and not (tmp_path / "plain" / "test").exists()
    with open(tmp_path / "plain" / "DATASET.json") as f:  # the default data's record is what it was
        assert set(json.load(f)) == {"train", "val", "num_classes", "image_size", "seed"}


def test_make_dataset_script_never_deletes_a_users_images(tmp_path):
    """Pointed at a folder of the user's own images, the script wrote its demo data over train/,
    val/ and test/ without a word. Refused in one line, exit 2, every byte kept; --force replaces."""
    import runpy

    from helpers import REPO

    main = runpy.run_path(str(REPO / "scripts" / "make_dataset.py"))["main"]
    mine = tmp_path / "photos"
    for i, split in enumerate(["train", "val", "test"]):
        (mine / split / "cats").mkdir(parents=True)
        (mine / split / "cats" / f"{i}.jpg").write_bytes(bytes([i]) * 100 + os.urandom(50))
    (mine / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()}
    small = ["--num-classes", "2", "--train-per-class", "2", "--val-per-class", "1", "--image-size", "16"]
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["--root", str(mine), *small]) == 2
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith(
        f"make_dataset.py: {mine} holds notes.txt, test, train, val but no DATASET.json"
    ), err.getvalue()
    assert {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()} == before  # byte for byte
    assert not list(tmp_path.glob("photos.partial-*"))  # nothing generated aside either
    # its own demo data is replaced without asking; a new or empty folder is written
    (tmp_path / "empty").mkdir()
    with redirect_stdout(io.StringIO()):
        for root in (tmp_path / "new", tmp_path / "empty", tmp_path / "new"):
            assert main(["--root", str(root), *small]) == 0
        assert main(["--root", str(mine), *small, "--force"]) == 0
    assert sorted(os.listdir(mine / "train")) == ["disc", "square"] and (mine / "notes.txt").exists()


def test_training_never_reads_the_test_split(with_test, monkeypatch):
    from omegaconf import OmegaConf

    from goodput.config import validate
    from goodput.data.loader import ResumableLoader, eval_loader

    root, _ = with_test
    touched = []
    original = Storage._path
    monkeypatch.setattr(Storage, "_path", lambda self, rel: touched.append(rel) or original(self, rel))
    overrides = [f"paths.root={root}/out", "experiment=smoke", f"data.root={root}", "data=remote"]
    c = validate(OmegaConf.to_container(compose_train(overrides), resolve=True))
    store, cpu = Storage(root), torch.device("cpu")
    train = ResumableLoader(c.data, store, 0, 8, 3, 0, 1, cpu, c.augment)
    for _ in train:
        pass
    for _ in eval_loader(c.data, store, 8, 0, 1, cpu, c.augment):
        pass
    assert any(r.startswith("train/") for r in touched) and any(r.startswith("val/") for r in touched)
    assert not [r for r in touched if r.split("/")[0] == "test"]


def loaded_of(classes=CLASSES) -> Loaded:
    spec = ModelSpec.parse(record(classes=classes), "x")
    return Loaded(spec.build().eval(), spec, "x", 1, "model")


def test_the_test_split_is_evaluated_when_present_and_refused_naming_it_when_absent(with_test, tmp_path):
    root, n = with_test
    node = {"_target_": "goodput.data.dataset.ImageFolder"}
    loader = evaluation_loader(loaded_of(), root, node, "test", 5, 0)
    assert sum(int((b["label"] >= 0).sum()) for b in loader) == n["test"]
    assert all(f.startswith("test/") for f in loader.dataset.files.files)
    make_dataset(str(tmp_path / "plain"), num_classes=4, train_per_class=4, val_per_class=2, image_size=16)
    with pytest.raises(InputError, match=r"has no test split \(no .*plain/test/<class>/<image>\)"):
        evaluation_loader(loaded_of(), str(tmp_path / "plain"), node, "test", 5, 0)
    from goodput.data.shards import pack  # a run trained on data.root=<shards packed ahead of time>

    pack(Storage(root), Storage(str(tmp_path / "packed")))
    with pytest.raises(InputError, match=r"packed into shards .*index.json\): .*pass --data-root"):
        evaluation_loader(loaded_of(), str(tmp_path / "packed"), node, "val", 5, 0)
    other = ["cross", "disc", "ring", "square"]  # the model's classes are not the split's
    with pytest.raises(InputError, match=r"missing there: \['ring'\], not trained on: \['triangle'\]"):
        evaluation_loader(loaded_of(other), root, node, "test", 5, 0)


def test_the_data_record_is_checked_and_the_root_can_be_moved():
    from goodput.inference import data_of

    m = loaded_of()
    node = {"_target_": "goodput.data.dataset.CsvManifest", "manifest": "{split}.csv"}
    m.commit = {"data": {"root": "/data/shapes", "dataset": node}}
    assert data_of(m, None) == ("/data/shapes", node)
    assert data_of(m, "/moved") == ("/moved", node)  # --data-root
    popen = {"_target_": "subprocess.Popen", "args": "true"}
    nested = {"_target_": "goodput.data.dataset.ImageFolder", "x": {"_target_": "os.system"}}
    for bad, message in [
        ({"root": "/d", "dataset": popen}, "not an ImageFolder class"),
        ({"root": "/d", "dataset": nested}, "key x._target_ is refused"),
        ({"root": "nope://d"}, "unknown storage protocol"),
        ([], "not an object"),
    ]:  # fmt: skip
        m.commit = {"data": bad}
        with pytest.raises(SpecError, match=message):
            data_of(m, None)
    m.commit = None  # a safetensors export or an MLflow model: no data record
    with pytest.raises(SpecError, match="names no dataset .*pass --data-root"):
        data_of(m, None)


# -- images -------------------------------------------------------------------------------------
def test_images_in_any_format_pillow_opens_and_bad_ones_named(tmp_path, with_test):
    from PIL import Image

    root, _ = with_test
    src = os.path.join(root, "val", "disc", "000000.jpg")
    with Image.open(src) as im:
        for ext in ("bmp", "webp", "tiff", "gif"):
            im.save(tmp_path / f"x.{ext}")
    ref = decode(src)
    for ext in ("bmp", "tiff"):  # lossless: the same pixels as the JPEG decoded
        assert torch.equal(decode(str(tmp_path / f"x.{ext}")), ref), ext
    for ext in ("webp", "gif"):
        assert decode(str(tmp_path / f"x.{ext}")).shape == ref.shape, ext
    # an animation is its first frame, as training reads it (torchvision's decoder gave all frames)
    frames = [Image.new("RGB", (12, 10), c) for c in ((200, 0, 0), (0, 200, 0), (0, 0, 200))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    got = decode(str(tmp_path / "anim.gif"))
    assert torch.equal(got, training_decode((tmp_path / "anim.gif").read_bytes()))
    assert got.shape == (3, 10, 12) and got[0].float().mean() > 150 and got[1:].float().mean() < 50
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(InputError, match=r"bad.jpg: cannot decode as an image"):
        decode(str(tmp_path / "bad.jpg"))
    with pytest.raises(InputError, match="nothere.png: no such file or folder"):
        image_files([str(tmp_path / "nothere.png")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no image files in this folder"):
        image_files([str(tmp_path / "empty")])
    files = image_files([os.path.join(root, "val"), str(tmp_path / "x.bmp")])
    assert len(files) == 9 and files[-1].endswith("x.bmp") and files[:8] == sorted(files[:8])


def test_a_corrupt_newest_commit_is_skipped_and_a_named_one_refused(tmp_path, dist1, caplog):
    from helpers import two_steps

    from goodput.checkpoint.export import CorruptCheckpoint

    mgr, app, remote = two_steps(tmp_path, dist1)  # steps 1 and 2, other weights
    shard = next(p for p in (remote / "step-000000002").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit flipped: only the checksum sees it
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="goodput.checkpoint.export"):
        got = read_weights(str(remote))
    assert got.step == 1 and "skipping" in caplog.text and "step-000000002" in caplog.text
    with pytest.raises(CorruptCheckpoint, match="does not match its commit record"):
        read_weights(str(remote), step=2)
    mgr.close()


def test_a_rescue_step_dir_is_read_when_named_and_for_its_step(tmp_path, dist1, monkeypatch):
    """A rescue (step-N.rescue) is a commit like any other: naming it reads it (not the regular
    save of its step), `--step N` reads it when no regular save of N is committed, and a bare step
    dir name is read from the current directory."""
    import shutil

    from helpers import two_steps

    mgr, app, remote = two_steps(tmp_path, dist1)  # steps 1 and 2, other weights
    for step, regular in ((1, 0), (2, 1)):  # a rescue beside step 1's save, one instead of step 2's
        rescue = remote / f"step-{step:09d}.rescue"
        shutil.copytree(remote / f"step-{step:09d}", rescue)
        rec = json.loads((rescue / "COMMIT.json").read_text())
        rec.update(kind="rescue", rescued_by=[0], regular_step=regular)
        (rescue / "COMMIT.json").write_text(json.dumps(rec))
    shutil.rmtree(remote / "step-000000002")
    head = app.model.head.weight.detach().clone()  # step 2's
    for source, step, want in [
        (remote / "step-000000002.rescue", None, "step-000000002.rescue"),
        (remote, 2, "step-000000002.rescue"),
        (remote / "step-000000001.rescue", None, "step-000000001.rescue"),
        (remote, 1, "step-000000001"),  # the regular save of a step before its rescue
        ("step-000000001", None, "step-000000001"),
    ]:
        monkeypatch.chdir(remote)
        got = read_weights(str(source), step=step)
        assert got.origin == str(remote / want) and got.step == int(want[5:14]), (source, step)
        assert torch.equal(got.state["head.weight"], head) == (got.step == 2)
    with pytest.raises(SourceError, match=r"03: not a committed checkpoint \(committed steps: \[2, 1\]\)"):
        read_weights(str(remote), step=3)
    mgr.close()


def test_predict_refusals_are_one_line_exit_2(tmp_path, with_test):
    import runpy

    from helpers import REPO

    main = runpy.run_path(str(REPO / "scripts" / "predict.py"))["main"]
    root, _ = with_test
    image = os.path.join(root, "test", "disc", "000000.jpg")
    bare = tmp_path / "bare.safetensors"  # weights without a model record (an older export)
    save_safetensors(SmallCNN(4, 8).state_dict(), str(bare))
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    good = tmp_path / "good.safetensors"
    save_safetensors(SmallCNN(4, 8).state_dict(), str(good), ModelSpec.parse(record(), "x").metadata())
    for argv, message in [
        ([str(bare), image], "bare.safetensors has no model record"),
        ([str(good), str(tmp_path / "missing.jpg")], "missing.jpg: no such file or folder"),
        ([str(good), str(tmp_path / "bad.png")], "bad.png: cannot decode as an image"),
        ([str(tmp_path / "nothing"), image], "no such directory"),
        ([str(good), image, "--step", "3"], "good.safetensors is an export of one step: --step applies"),
        ([str(good), image, "--weights", "ema"], "good.safetensors holds the model weights, not the ema"),
    ]:
        err = io.StringIO()
        with redirect_stderr(err):
            assert main(argv) == 2, argv
        assert message in err.getvalue() and err.getvalue().count("\n") == 1, err.getvalue()
    usage = [("--top-k", "0", "0 is below 1"), ("--batch-size", "0", "0 is below 1"),
             ("--step", "-1", "-1 is below 0"), ("--top-k", "x", "'x' is not an integer")]  # fmt: skip
    for flag, value, message in usage:
        err = io.StringIO()
        with redirect_stderr(err), pytest.raises(SystemExit) as stop:
            main([str(good), image, flag, value])  # argparse's usage error, before anything is read
        assert stop.value.code == 2 and f"argument {flag}: {message}" in err.getvalue(), err.getvalue()
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([str(good), image]) == 0
    header, row = list(csv.reader(io.StringIO(out.getvalue())))
    assert header == ["path", "class", "probability", "top4"] and row[0] == image and row[1] in CLASSES


def test_predict_reads_images_as_training_does_no_fifo_no_link(tmp_path, with_test, caplog):
    """A FIFO named like an image in a folder blocked predict.py forever; a link in it was followed
    out of the folder. Walking a folder, both are skipped and counted; named, each is refused."""
    import runpy
    import shutil
    import threading

    from helpers import REPO

    main = runpy.run_path(str(REPO / "scripts" / "predict.py"))["main"]
    good = tmp_path / "good.safetensors"
    save_safetensors(SmallCNN(4, 8).state_dict(), str(good), ModelSpec.parse(record(), "x").metadata())
    images, outside = tmp_path / "images", tmp_path / "outside"
    images.mkdir()
    outside.mkdir()
    shutil.copy(os.path.join(with_test[0], "test", "disc", "000000.jpg"), images / "a.jpg")
    shutil.copy(os.path.join(with_test[0], "test", "disc", "000001.jpg"), outside / "secret.jpg")
    os.mkfifo(images / "b.jpg")
    (images / "c.jpg").symlink_to(outside / "secret.jpg")
    (images / "sub").symlink_to(outside)

    def bounded(argv):
        """main(argv) -> (rc, stdout, stderr); a read that blocks fails the test instead of hanging it."""
        result, out, err = [], io.StringIO(), io.StringIO()

        def run():
            with redirect_stdout(out), redirect_stderr(err):
                result.append(main(argv))

        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(timeout=20)
        if th.is_alive():
            with open(images / "b.jpg", "wb"):  # a writer: the blocked open returns (EOF), the thread ends
                pass
            th.join(timeout=20)
            pytest.fail(f"predict.py {argv} blocked reading a FIFO")
        return result[0], out.getvalue(), err.getvalue()

    with caplog.at_level(logging.WARNING, logger="goodput.inference"):
        rc, out, _ = bounded([str(good), str(images)])
    assert rc == 0
    assert [row[0] for row in csv.reader(io.StringIO(out))][1:] == [str(images / "a.jpg")]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"{images}: skipped 3 entries that are symbolic links or special"), warning
    assert all(str(images / n) in warning for n in ("b.jpg", "c.jpg", "sub")), warning
    for name, kind in [("b.jpg", "a FIFO"), ("c.jpg", "a symbolic link")]:
        rc, out, err = bounded([str(good), str(images / name)])
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert f"{images / name} is not a regular file ({kind}); refused" in err, err


def test_a_record_the_model_cannot_be_built_from_or_fitted_to_is_one_line_exit_2(tmp_path, dist1):
    """A record whose arguments make the constructor raise (a negative width, an argument the class
    does not take) ended evaluate.py and predict.py in Hydra's traceback; weights that do not fit it
    in a message of many lines. One line each, exit 2, naming the step dir and the argument."""
    import runpy

    from helpers import REPO

    src, _ = source_run(tmp_path, dist1)
    step = f"{src}/step-000000007"
    commit = json.loads((tmp_path / "remote" / "step-000000007" / "COMMIT.json").read_text())
    image = tmp_path / "a.png"
    from PIL import Image

    Image.new("RGB", (16, 16)).save(image)
    for node, message in [
        ({"width": -1}, "width must be a multiple of 8"),
        ({"depth": 3}, "unexpected keyword argument 'depth'"),
        ({"width": 16}, "the weights do not fit its model record"),
    ]:
        edited = {**commit, "model": {**commit["model"], "node": {**commit["model"]["node"], **node}}}
        (tmp_path / "remote" / "step-000000007" / "COMMIT.json").write_text(json.dumps(edited))
        argument = "{}={!r}".format(*next(iter(node.items())))
        for script, argv in [("evaluate.py", [step, "--no-mlflow"]), ("predict.py", [step, str(image)])]:
            main = runpy.run_path(str(REPO / "scripts" / script))["main"]
            err = io.StringIO()
            with redirect_stderr(err), redirect_stdout(io.StringIO()):
                assert main(argv) == 2, (script, node)
            line = err.getvalue()
            assert line.count("\n") == 1 and line.startswith(f"{script}: {step}: "), line
            assert message in line and "goodput.model.SmallCNN(width=" in line and argument in line, line


def test_class_names_from_a_record_are_printed_escaped(tmp_path, with_test):
    """predict.py's CSV and evaluate.py's table print the record's class names: a `\r` and an escape
    sequence in one are shown escaped, never sent raw to the terminal."""
    import runpy
    import shutil

    from helpers import REPO

    data = tmp_path / "data"
    shutil.copytree(with_test[0], data)
    evil = "disc\r\x1b[2K\u202e"
    (data / "val" / "disc").rename(data / "val" / evil)
    classes = sorted(os.listdir(data / "val"))
    model = tmp_path / "m.safetensors"
    spec = ModelSpec.parse(record(classes=classes), "x")
    save_safetensors(SmallCNN(4, 8).state_dict(), str(model), spec.metadata())
    image = str(data / "val" / "cross" / "000000.jpg")
    for script, argv in [("predict.py", [str(model), image]),
                         ("evaluate.py", [str(model), "--data-root", str(data), "--no-mlflow"])]:  # fmt: skip
        main = runpy.run_path(str(REPO / "scripts" / script))["main"]
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(argv) == 0, script
        text = out.getvalue().replace("\r\n", "\n")  # (the CSV's own line ends)
        assert "disc\\r\\x1b[2K\\u202e" in text, text
        assert not [c for c in text if not c.isprintable() and c != "\n"], (script, text)


def test_a_path_that_is_not_there_is_the_one_run_dir_named_like_it(tmp_path, monkeypatch):
    """`outputs/checkpoints/demo` after `make train`: the run dir is demo-<8 hex digits> (the
    experiment plus its identity digest). Only that exact form beside the path counts, and only a
    real directory; a path that exists, a URL, or no such sibling: the source as given."""
    from goodput.checkpoint.export import run_dir

    for name in ["demo-extra-1a2b3c4d", "demo-1a2b3c4", "demo-1A2B3C4D", "demo-1a2b3c4d5", "demox-1a2b3c4d"]:
        (tmp_path / name).mkdir()  # not the form: a longer name, 7 or 9 digits, upper case
    (tmp_path / "demo-0000000f").write_text("a file")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "demo-abcdef01").symlink_to(tmp_path / "elsewhere")
    said = []
    assert run_dir(str(tmp_path / "demo"), say=said.append) == str(tmp_path / "demo")  # none counts
    (tmp_path / "demo-1a2b3c4d").mkdir()
    assert run_dir(str(tmp_path / "demo") + "/", say=said.append) == str(tmp_path / "demo-1a2b3c4d")
    (line,) = said
    assert line == (
        f"{tmp_path}/demo/: no such directory; using {tmp_path}/demo-1a2b3c4d, "
        "the one run named demo-<digest>"
    )
    monkeypatch.chdir(tmp_path)  # relative, as the README's commands are
    assert run_dir("demo", say=said.append) == "demo-1a2b3c4d" and len(said) == 2
    (tmp_path / "elsewhere-1a2b3c4d").mkdir()
    used_as_given = [
        str(tmp_path / "elsewhere"),  # it exists (and so does elsewhere-1a2b3c4d)
        "s3://bucket/demo",
        "models:/demo",
        "demo.safetensors",
        str(tmp_path / "nowhere" / "demo"),
        str(tmp_path / "demo-1a2b3c4d" / "step-000000004"),
    ]
    for source in used_as_given:
        assert run_dir(source, say=said.append) == source
    assert len(said) == 2


def test_several_run_dirs_named_like_a_missing_path_are_refused_newest_first(tmp_path):
    from goodput.checkpoint.export import run_dir

    for i, name in enumerate(["demo-aaaaaaaa", "demo-cccccccc", "demo-bbbbbbbb"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1e9 + i, 1e9 + i))  # bbbbbbbb newest, then cccccccc
    with pytest.raises(SourceError) as e:
        run_dir(str(tmp_path / "demo"), say=pytest.fail)
    assert str(e.value) == (
        f"{tmp_path}/demo: no such directory, and 3 runs are named demo-<digest> (newest first): "
        f"{tmp_path}/demo-bbbbbbbb, {tmp_path}/demo-cccccccc, {tmp_path}/demo-aaaaaaaa; name one"
    )


def test_runs_are_listed_by_their_newest_commit_not_by_who_touched_their_dir_last(tmp_path):
    """A relaunch of a complete run ("nothing to do") takes and drops its lock in the run dir: the
    older run was listed first in the newcomer walk, above the one just trained."""
    from goodput.checkpoint.export import run_dir

    for i, name in enumerate(["demo-aaaaaaaa", "demo-bbbbbbbb"]):  # bbbbbbbb trained last
        commit = tmp_path / name / "step-000000004" / "COMMIT.json"
        commit.parent.mkdir(parents=True)
        commit.write_text("{}")
        os.utime(commit, (1e9 + i, 1e9 + i))
    os.utime(tmp_path / "demo-aaaaaaaa", (2e9, 2e9))  # aaaaaaaa relaunched since: its dir touched
    (tmp_path / "demo-aaaaaaaa" / "step-000000002.rescue").mkdir()  # no commit: never counts
    with pytest.raises(SourceError, match=re.escape(f"{tmp_path}/demo-bbbbbbbb, {tmp_path}/demo-aaaaaaaa;")):
        run_dir(str(tmp_path / "demo"), say=pytest.fail)


def test_the_scripts_refuse_several_run_dirs_in_one_line_exit_2(tmp_path, monkeypatch, with_test):
    import runpy

    from helpers import REPO

    (tmp_path / "demo-aaaaaaaa").mkdir()
    (tmp_path / "demo-bbbbbbbb").mkdir()
    image = os.path.join(with_test[0], "test", "disc", "000000.jpg")
    source = str(tmp_path / "demo")
    for script, argv in [("evaluate.py", [source, "--no-mlflow"]), ("predict.py", [source, image]),
                         ("inspect_checkpoint.py", [source])]:  # fmt: skip
        err = io.StringIO()
        monkeypatch.setattr("sys.argv", [script, *argv])
        with redirect_stderr(err):
            try:
                rc = runpy.run_path(str(REPO / "scripts" / script), run_name="__main__")["main"](argv)
            except SystemExit as stop:
                rc = stop.code
        assert rc == 2, script
        line = err.getvalue()
        assert line.count("\n") == 1 and line.startswith(f"{script}: {source}: no such directory"), line
        assert f"{tmp_path}/demo-aaaaaaaa" in line and f"{tmp_path}/demo-bbbbbbbb" in line


def test_a_script_run_in_process_leaves_the_collector_as_it_found_it(monkeypatch):
    """The entry points freeze the collector for a fast exit; run in-process (runpy, a notebook, a
    test), main() returns to a caller whose later garbage must still be collected."""
    import gc
    import runpy

    from helpers import REPO, process_state_kept

    assert gc.get_freeze_count() == 0
    try:
        for script in ["train.py", "evaluate.py", "predict.py", "inspect_checkpoint.py"]:
            monkeypatch.setattr("sys.argv", [script, "--help"])
            with process_state_kept(), redirect_stdout(io.StringIO()) as out:  # train.py sets up logging
                try:
                    runpy.run_path(str(REPO / "scripts" / script), run_name="__main__")
                except SystemExit as stop:
                    assert stop.code in (0, None), script
            assert script in out.getvalue(), script  # its help, so its __main__ block ran
            assert gc.get_freeze_count() == 0, f"{script} left the collector frozen"
    finally:
        gc.unfreeze()  # never hand a frozen collector to the worker's next test


def test_evaluate_logs_in_the_store_of_the_root_the_checkpoint_lies_under(tmp_path, monkeypatch):
    """#48: evaluate.py took the first mlflow.db in any of the four folders above the path given, so
    an unrelated store above a checkpoint (a home folder's, a colleague's) got the evaluation run.
    Only `<root>/mlflow.db` of a `<root>/checkpoints/<run>` layout is the run's own store."""
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("evaluate_script", REPO / "scripts" / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    used = []
    monkeypatch.setattr(script, "run", lambda a: used.append(a.tracking_uri) or 0)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "mlflow.db").write_bytes(b"")  # planted above, in an unrelated ancestor
    elsewhere = tmp_path / "a" / "runs" / "demo-1a2b3c4d" / "step-000000004"
    root = tmp_path / "a" / "b" / "out"
    (root / "mlflow.db").parent.mkdir(parents=True)
    (root / "mlflow.db").write_bytes(b"")
    named = root / "checkpoints" / "checkpoints" / "step-000000004"  # run.name=checkpoints
    trial = root / "checkpoints" / "study-1a2b3c4d" / "trial-001"
    for ckpt in (elsewhere, named, trial):
        ckpt.mkdir(parents=True)
    assert script.main([str(elsewhere)]) == 0 and used[-1] == script.DEFAULT_STORE
    assert script.main([str(named)]) == 0 and used[-1] == f"sqlite:///{root}/mlflow.db"
    assert script.main([str(trial)]) == 0 and used[-1] == f"sqlite:///{root}/mlflow.db"
    assert script.main([str(trial), "--tracking-uri", "sqlite:///x.db"]) == 0 and used[-1] == "sqlite:///x.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert script.main([str(trial)]) == 0 and used[-1] == "http://mlflow.example:5000"
