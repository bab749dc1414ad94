"""What a run prints, in-process: one log format (goodput.logs), warnings as one line and the known
harmless ones hidden at their call, progress lines without a terminal (goodput.run.progress), and a
`_target_` swapped on the command line refused when it would receive keys it does not take
(goodput.targets). The entry point's view of the same: e2e/test_messages_runs.py."""

from __future__ import annotations

import io
import logging
import re
import sys
import warnings

import pytest
import torch
from helpers import compose_train, two_steps
from hydra.utils import instantiate
from omegaconf import OmegaConf

from goodput import logs, targets
from goodput.config import ConfigError, validate
from goodput.run.progress import Progress, duration

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) (job|rank\d+) [\w.]+: \S")


@pytest.fixture
def logged():
    """goodput.logs.setup on a root logger that writes to a buffer; everything it changes restored."""
    import mlflow  # noqa: F401 - MLflow configures its loggers on import; setup must undo that

    root = logging.getLogger()
    saved_root = (root.handlers[:], root.level)
    named = [logging.getLogger(n) for n in (*logs.MLFLOW_LOGGERS, *logs.QUIET)]
    saved_named = [(lg.handlers[:], lg.propagate, lg.level) for lg in named]
    saved = (warnings.showwarning, logs._who)
    buf = io.StringIO()
    root.handlers = [logging.StreamHandler(buf)]
    try:
        yield buf
    finally:
        root.handlers, root.level = saved_root
        for lg, (h, p, lvl) in zip(named, saved_named):
            lg.handlers, lg.propagate, lg.level = h, p, lvl
        warnings.showwarning, logs._who = saved


def test_one_format_for_goodput_mlflow_and_warnings(logged):
    logs.setup()
    logging.getLogger("goodput.x").info("before a rank")
    logs.setup(rank=3)
    logging.getLogger("goodput.x").warning("from a rank")
    logging.getLogger("mlflow.tracking").info("an MLflow line")
    logging.getLogger("mlflow.system_metrics.system_metrics_monitor").info("Skip logging GPU metrics")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = logs._log_warning  # what setup installed (catch_warnings saved the old one)
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
    lines = logged.getvalue().splitlines()
    assert len(lines) == 4, lines  # the system-metrics chatter is quieted
    assert all(LINE.match(line) for line in lines), lines
    assert " INFO job goodput.x: before a rank" in lines[0]
    assert " WARNING rank3 goodput.x: from a rank" in lines[1]
    assert " INFO rank3 mlflow.tracking: an MLflow line" in lines[2]
    assert " WARNING rank3 py.warnings: UserWarning: a library's warning (" in lines[3]


@pytest.mark.parametrize("node", ["job_logging", "hydra_logging"])
def test_hydras_own_log_config_prints_the_one_format_to_stderr(node, logged):
    """Hydra configures logging before the job runs (and its launcher's lines in `-m`): conf/hydra
    points both of its configs at goodput.logs.Formatter."""
    import logging.config

    cfg = OmegaConf.to_container(compose_train(["paths.root=/tmp/unused"], hydra=True).hydra[node])
    cfg["handlers"].pop("file", None)  # (its file name needs a run)
    cfg["root"]["handlers"] = ["console"]
    logging.config.dictConfig(cfg)
    handlers = logging.getLogger().handlers
    assert handlers and all(isinstance(h.formatter, logs.Formatter) for h in handlers)
    assert all(h.stream is sys.stderr for h in handlers)
    cfg = OmegaConf.to_container(compose_train(["paths.root=/tmp/unused"], hydra=True).hydra.job_logging)
    assert cfg["handlers"]["file"]["formatter"] == cfg["handlers"]["console"]["formatter"]
    assert cfg["handlers"]["file"]["filename"].endswith("/" + logs.FILE)


def test_rank_zero_of_elastic_workers_appends_to_the_run_log(logged, tmp_path, monkeypatch):
    """The job process writes train.log through Hydra; the elastic agent's workers have no Hydra."""
    logging.getLogger().handlers = []  # a worker from the forkserver starts with none
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    (tmp_path / logs.FILE).write_text("a line of the job process\n")
    logs.setup(1, str(tmp_path))
    logs.setup(0, str(tmp_path))
    logs.setup(0, str(tmp_path))  # once
    logging.getLogger("goodput").info("from rank 0")
    try:
        lines = (tmp_path / logs.FILE).read_text().splitlines()
    finally:
        for h in logging.getLogger().handlers:
            h.close()
    assert lines[0] == "a line of the job process" and len(lines) == 2 and LINE.match(lines[1])
    assert lines[1].endswith(" INFO rank0 goodput: from rank 0")


def test_a_known_warning_is_hidden_only_around_its_call():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with logs.known_warning("torch.distributed is disabled", __name__):
            warnings.warn("torch.distributed is disabled, unavailable or uninitialized", stacklevel=1)
            warnings.warn("another warning", stacklevel=1)
        warnings.warn("torch.distributed is disabled, again", stacklevel=1)
    assert [str(w.message) for w in seen] == ["another warning", "torch.distributed is disabled, again"]


def test_reading_a_dcp_checkpoint_on_one_process_does_not_warn(tmp_path, dist1):
    """The export (the MLflow model, inspect_checkpoint --export) reads on purpose without a
    process group; DCP's 'torch.distributed is disabled' UserWarning printed on every such run."""
    from goodput.checkpoint.export import model_state

    mgr, app, _ = two_steps(tmp_path, dist1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sd = model_state(mgr.storage, max(mgr.committed(), key=lambda r: r["step"]))
    assert torch.equal(sd["head.weight"], app.model.head.weight.detach())
    assert [str(w.message) for w in seen if issubclass(w.category, UserWarning)] == []


# -- progress -----------------------------------------------------------------------------------
def _progress(caplog, mode="lines", every_s=0.0, rank=0, steps=(2, 4, 6)):
    with caplog.at_level(logging.INFO, logger="goodput.run.progress"):
        p = Progress(mode, every_s, 0, 6, rank)
        for s in steps:
            p.logged(s, 2.5 - s / 10, 0.05, 1234.0, 0.01)
            p.advance()
        p.evaluated(6, {"val/loss": 1.25, "val/accuracy": 0.5, "val/top5": 0.75, "val/class/a": 1.0})
        p.close()
    return [r.getMessage() for r in caplog.records if r.name == "goodput.run.progress"]


def test_progress_lines_carry_step_loss_lr_speed_and_eta(caplog):
    lines = _progress(caplog)
    assert re.fullmatch(r"step 2/6 \(33%\)  loss 2\.3000  lr 0\.05  1234 img/s  eta \d+s", lines[0]), lines
    assert [line.split()[1] for line in lines[:3]] == ["2/6", "4/6", "6/6"]
    assert lines[3] == "eval at step 6: val loss 1.2500, accuracy 0.5000, top5 0.7500"


def test_progress_lines_at_most_one_per_interval_plus_the_last(caplog):
    lines = _progress(caplog, every_s=3600)
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["2/6", "6/6"]


@pytest.mark.parametrize("mode, rank", [("bar", 0), (False, 0), ("lines", 1), ("auto", 1)])
def test_no_progress_lines_with_the_bar_off_or_on_other_ranks(caplog, mode, rank):
    lines = _progress(caplog, mode=mode, rank=rank)
    assert [line for line in lines if line.startswith("step")] == []
    assert len([line for line in lines if line.startswith("eval")]) == (mode == "bar")  # the bar: eval lines


@pytest.mark.parametrize("terminal", [True, False])
def test_auto_prints_lines_when_stderr_is_not_a_terminal_and_the_bar_when_it_is(
    caplog, monkeypatch, terminal
):
    class Stderr(io.StringIO):  # a terminal, or a file (a SLURM log); pytest's own is never a terminal
        def isatty(self):
            return terminal

    monkeypatch.setattr("sys.stderr", Stderr())
    lines = _progress(caplog, mode="auto")
    assert len([line for line in lines if line.startswith("step")]) == (0 if terminal else 3)
    assert ("3/6 [" in sys.stderr.getvalue()) == terminal  # tqdm's bar, drawn on that stderr


def test_durations():
    assert [duration(s) for s in (0.4, 42, 185, 3720)] == ["0s", "42s", "3m05s", "1h02m"]


# -- a _target_ swapped on the command line ------------------------------------------------------
def _check(*overrides):
    cfg = compose_train(["experiment=smoke", "paths.root=/tmp/unused", *overrides], hydra=True)
    targets.check(cfg, list(cfg.hydra.overrides.task), dict(cfg.hydra.runtime.choices))
    return cfg


@pytest.mark.parametrize(
    "override, keys, target, file, undo",
    [
        # mobilenet_v3_small takes **kwargs and ignores `width`: it trained silently
        ("model._target_=torchvision.models.mobilenet_v3_small", "model.width",
         "torchvision.models.mobilenet_v3_small", "conf/model/small_cnn.yaml", "~model.width"),
        # resnet18 hands its **kwargs to ResNet, which raised a TypeError traceback in the worker
        ("model._target_=torchvision.models.resnet18", "model.width", "torchvision.models.resnet18",
         "conf/model/small_cnn.yaml", "~model.width"),
        ("model={_target_:torchvision.models.resnet18}", "model.width", "torchvision.models.resnet18",
         "conf/model/small_cnn.yaml", "~model.width"),
        ("optim.optimizer._target_=torch.optim.Adam", "optim.optimizer.momentum", "torch.optim.Adam",
         "conf/optim/sgd.yaml", "~optim.optimizer.momentum"),
        ("optim.schedule._target_=torch.optim.lr_scheduler.StepLR",
         "optim.schedule.warmup_steps, optim.schedule.min_lr_ratio, optim.schedule.total_steps, "
         "optim.schedule.warmup_epochs",
         "torch.optim.lr_scheduler.StepLR", "conf/optim/schedule/cosine.yaml",  # (smoke selects it)
         "~optim/schedule 'optim.schedule={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,"),
    ],
)  # fmt: skip
def test_a_swapped_target_with_the_old_options_keys_is_refused_naming_them(
    override, keys, target, file, undo
):
    with pytest.raises(ConfigError) as e:
        _check(override)
    msg = str(e.value)
    assert "\n" not in msg
    group = file.removeprefix("conf/").rsplit("/", 1)[0]
    for part in (f"{keys} (from {file})", f"passed to {target}", f"conf/{group}/<name>.yaml",
                 f"`_target_: {target}`", f"{group}=<name>", f"on the command line: {undo}"):  # fmt: skip
        assert part in msg, (part, msg)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=resnet18"],
        ["model=resnet18", "model._target_=torchvision.models.resnet34"],  # `weights` is a parameter
        ["~model.width", "model._target_=torchvision.models.mobilenet_v3_small"],
        ["model=resnet18", "+model.zero_init_residual=true"],  # set on the command line: into **kwargs
        ["optim=adamw"],
        ["optim.optimizer._target_=torch.optim.Adam", "~optim.optimizer.momentum"],
    ],
)
def test_targets_that_take_their_keys_pass(overrides):
    _check(*overrides)


def test_a_key_no_target_could_take_is_refused_even_unswapped():
    with pytest.raises(
        ConfigError, match=r"optim.optimizer.nesterov_typo .*torch.optim.SGD.*no such parameter"
    ):
        _check("+optim.optimizer.nesterov_typo=true")


@pytest.mark.parametrize(
    "overrides",
    [
        ["optim/schedule=step", "optim.schedule.step_size=3"],  # the option-file way
        # the command-line way the refusal shows (the typed schedule's keys cannot be deleted one by one)
        ["~optim/schedule",
         "optim.schedule={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:3}"],
    ],
)  # fmt: skip
def test_a_schedule_swapped_from_the_command_line_builds(overrides):
    _check(*overrides)
    cfg = compose_train(["experiment=smoke", "paths.root=/tmp/unused", *overrides])
    c = validate(OmegaConf.to_container(cfg, resolve=True))
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    sched = instantiate(c.optim.schedule)(opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and sched.step_size == 3


@pytest.mark.parametrize(
    "override, said",
    [
        ("model._target_=torchvision.models.resnt18",
         "model._target_=torchvision.models.resnt18: no such object"),
        ("model._target_=nosuchpackage.Net", "model._target_=nosuchpackage.Net: no such object"),
        ("model._target_=torchvision.models", "model._target_=torchvision.models is a module"),
        ("model._target_=dict", "model._target_=dict: not a dotted path"),  # a builtin: hydra cannot
        ("optim.optimizer._target_=torch.optim.Sgd", "optim.optimizer._target_=torch.optim.Sgd: no such"),
        ("optim.schedule._target_=torch.optim.lr_scheduler.Cosine",
         "optim.schedule._target_=torch.optim.lr_scheduler.Cosine: no such object"),
    ],
)  # fmt: skip
def test_a_target_that_is_not_there_is_refused_before_any_work(override, said, caplog):
    """A typo in a `_target_` is one line naming the key, not a traceback from the workers after the
    demo data, the run lock and an MLflow run; and no ERROR line of hydra's before it."""
    with pytest.raises(ConfigError) as e:
        _check(override)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.parametrize(
    "module, said",
    [
        ("import math\nraise RuntimeError('CUDA extension\\nnot built')\n",
         "RuntimeError: CUDA extension not built"),  # a multi-line error: one line still
        ("def __getattr__(name):\n    raise ImportError('lazy: needs the extras')\n",  # a lazy module
         "ImportError: lazy: needs the extras"),
    ],
)  # fmt: skip
def test_a_target_whose_module_raises_on_import_names_the_error(tmp_path, monkeypatch, module, said):
    (tmp_path / "brokenmodels.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "brokenmodels", raising=False)
    with pytest.raises(ConfigError) as e:
        _check("model._target_=brokenmodels.Net", "~model.width")
    assert str(e.value) == f"model._target_=brokenmodels.Net: importing it failed: {said}", str(e.value)
