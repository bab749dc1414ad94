"""The `_target_` nodes a command line may swap (the model, the optimizer, the LR schedule): each
must receive only keys its new target takes.

`model._target_=torchvision.models.resnet18` on the command line keeps every other key of the
selected option file (small_cnn's `width: 32`): Hydra merges an override into the node. A target
without **kwargs then fails on its call with a TypeError, one with **kwargs (torchvision's model
builders) takes the key silently, and mobilenet_v3_small ignores it. So before any work a key the
target does not take by name is refused, naming it, the target and the option-file way, when the
target cannot take it at all, or when the target was swapped on the command line and the key was
not set there (it came with the old option: a **kwargs would swallow it). A key the command line
set itself for a **kwargs target is the user's call (docs/config.md, "Swapping a target").

A target that cannot be found (`model._target_=torchvision.models.resnt18`) or is not callable is
refused here too: before the demo data, the run lock and the MLflow run, not in the workers."""

from __future__ import annotations

import inspect
import pydoc

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from goodput.config import ConfigError

# node -> (its group, how the command line drops a key of it: the schedule is a typed node, whose
# keys Hydra cannot delete, so the whole group goes and the node is given whole)
SWAPPABLE = {
    "model": ("model", "~model.{key}"),
    "task": ("task", "~task.{key}"),
    "task.loss": ("task", "~task.loss.{key}"),
    "batch_augment": ("batch_augment", "~batch_augment.{key}"),
    "optim.optimizer": ("optim", "~optim.optimizer.{key}"),
    "optim.schedule": (
        "optim/schedule",
        "~optim/schedule 'optim.schedule={{_target_:{target},_partial_:true,...}}'",
    ),
}
META = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}  # instantiate's, not the target's


def check(cfg: DictConfig, overrides: list[str], choices: dict) -> None:
    """Raise ConfigError (one line) for the keys of SWAPPABLE nodes their target does not take.
    `overrides`: the command line's (Hydra's task overrides); `choices`: the selected options."""
    on_cli = set_by(overrides)
    problems = []
    for path, (group, drop) in SWAPPABLE.items():
        node = OmegaConf.select(cfg, path)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        target = node["_target_"]
        missing = unusable(path, target)
        if missing:
            problems.append(missing)
            continue
        taken, var_kw = parameters(target)
        if taken is None:
            continue  # no signature to read (a builtin): instantiate names a bad key
        swapped = f"{path}._target_" in on_cli
        # a **kwargs target may be meant to take a key the command line set, or one its option had
        suspect = [k for k in node if not (var_kw and (f"{path}.{k}" in on_cli or not swapped))]
        foreign = [k for k in suspect if k not in META and k not in taken]
        if not foreign:
            continue
        keys = ", ".join(f"{path}.{k}" for k in foreign)
        where = f"conf/{group}/{choices.get(group)}.yaml" if swapped else "the config"
        why = (
            "it names no such parameter: its **kwargs would pass it on unchecked"
            if var_kw
            else "no such parameter"
        )
        undo = " ".join(dict.fromkeys(drop.format(key=k, target=target) for k in foreign))
        problems.append(
            f"{keys} (from {where}) would be passed to {target}, which does not take it ({why}). "
            f"A new target goes in its own option file, conf/{group}/<name>.yaml with `_target_: {target}` "
            f"and only its own keys, selected with {group}=<name>; or on the command line: {undo}"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def set_by(overrides: list[str]) -> set[str]:
    """The keys these overrides set (a dict value sets each of its keys); deletions set none."""
    out = set()
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if o.is_delete():
            continue
        key, value = o.key_or_group, o.value()
        out.add(key)
        if isinstance(value, dict):
            out |= {f"{key}.{k}" for k in value}
    return out


def unusable(path: str, target) -> str | None:
    """Why `path._target_=target` cannot be built, or None. pydoc.locate, not hydra's get_object:
    a miss is None (get_object logs an ERROR line of its own first)."""
    if "." not in str(target):  # `dict`, `print`: pydoc finds builtins, hydra's instantiate does not
        return f"{path}._target_={target}: not a dotted path (module.name)"
    try:
        obj = pydoc.locate(str(target))
    except Exception as e:  # the module is there and raised while importing (or a lazy attribute did)
        err = e.value if isinstance(e, pydoc.ErrorDuringImport) else e
        why = " ".join(f"{type(err).__name__}: {err}".split())  # one line
        return f"{path}._target_={target}: importing it failed: {why}"
    if obj is None:
        return (
            f"{path}._target_={target}: no such object (a typo? its module must be importable "
            "here: installed, or on PYTHONPATH)"
        )
    if not callable(obj):
        return f"{path}._target_={target} is a {type(obj).__name__}, not a class or function"
    return None


def parameters(target: str) -> tuple[set[str] | None, bool]:
    """(the names `target` takes as keywords, whether it takes **kwargs); (None, False) when it
    has no signature."""
    try:
        params = inspect.signature(pydoc.locate(target)).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return None, False
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params)
