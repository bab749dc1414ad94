"""What weights need besides themselves to be used: the model's `_target_` node, the task's (how
logits become a prediction, and its loss), the class names (label i is classes[i]), the image size
and the normalization. A run records it in every commit
(`model` in COMMIT.json), `inspect_checkpoint.py --export` copies it into the safetensors metadata,
and the logged MLflow model carries it (its MLmodel metadata and the module's `goodput` attribute),
so evaluate.py and predict.py need nothing but the checkpoint, the export or the model URI.

Read back, a spec is untrusted input (whoever writes the store writes it): `ModelSpec.parse` checks
every field, and `build` calls the `_target_` only when it names an `nn.Module` class or a builder
of `torchvision.models` (or one the caller allows), with plain values for arguments or nodes
whose own `_target_` passes the same check (the nested `net: {_target_: ...}` form), no other Hydra
instruction, and never weights downloaded from anywhere (every `weights*` argument is None,
`pretrained*` is refused). The task is built only from a subclass of goodput.recipe.task.Task.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass

import torch
from torch import nn

from goodput.data import augment
from goodput.untrusted import RecordError, parse_record

# Functions that may build a model from a record: torchvision's builders. (goodput's model is a
# class; a goodput *function* could write files where the record says, e.g. the demo data generator.)
BUILDERS = ("torchvision.models",)
FIELDS = ("node", "classes", "image_size", "mean", "std")  # every record has them
OPTIONAL = ("task", "resize_size")  # older records have neither: classification; resize = image_size
DEFAULT_TASK = {
    "_target_": "goodput.recipe.task.Classification",
    "loss": {"_target_": "torch.nn.CrossEntropyLoss"},
}


class SpecError(RecordError):
    """A model record (commit, export metadata, MLflow metadata) that is missing or malformed."""


@dataclass(frozen=True)
class ModelSpec:
    node: dict  # the `model` config node: `_target_` and its arguments (num_classes is added)
    classes: list[str]
    image_size: int
    mean: list[float]
    std: list[float]
    task: dict | None = None  # the `task` node (None: a record from before it: DEFAULT_TASK)
    resize_size: int | None = None  # the eval view's resize before the image_size crop (None: image_size)

    @classmethod
    def of(cls, c, classes: list[str], image_size: int, resize_size: int | None = None) -> ModelSpec:
        """The spec of a run's model (`c`: goodput.config.Config) trained on `classes`. The config is
        copied whole, like summary.json's (`asdict`, `dict`): a record, not a second reader of its keys."""
        mean, std = (asdict(c.augment)[k] for k in ("mean", "std"))
        node, task = (json.loads(json.dumps(dict(n))) for n in (c.model, c.task))  # plain copies
        resize = int(resize_size) if resize_size not in (None, image_size) else None
        return cls(node, list(classes), int(image_size), [float(v) for v in mean], [float(v) for v in std],
                   task, resize)  # fmt: skip

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def record(self) -> dict:
        return asdict(self)

    def metadata(self) -> dict[str, str]:
        """safetensors metadata (strings only): each field as JSON."""
        return {k: json.dumps(v) for k, v in self.record().items()}

    @classmethod
    def from_metadata(cls, meta: dict[str, str] | None, what: str) -> ModelSpec:
        meta = meta or {}
        missing = [k for k in FIELDS if k not in meta]
        if missing:
            raise SpecError(
                f"{what} carries no model record ({', '.join(missing)} missing from its metadata): export "
                f"it again with scripts/inspect_checkpoint.py --export from a checkpoint of this goodput"
            )
        keys = [k for k in FIELDS + OPTIONAL if k in meta]
        return cls.parse({k: parse_record(meta[k], f"{what} metadata {k!r}", object) for k in keys}, what)

    @classmethod
    def parse(cls, rec: object, what: str) -> ModelSpec:
        """A spec from an untrusted record, every field checked; SpecError naming `what` and the field."""
        if rec is None:
            raise SpecError(
                f"{what} has no model record (written before goodput recorded one): load its weights "
                f"into the model class yourself (docs/outputs.md, loading the model)"
            )
        if not isinstance(rec, dict):
            raise SpecError(f"{what}: the model record is a {type(rec).__name__}, not an object")
        node, classes, size = rec.get("node"), rec.get("classes"), rec.get("image_size")
        check_node(node, f"{what}: model node", nested=True)
        if not (isinstance(classes, list) and classes and all(isinstance(c, str) and c for c in classes)):
            raise SpecError(f"{what}: classes must be a non-empty list of names, got {str(classes)[:200]}")
        if len(set(classes)) != len(classes):
            raise SpecError(f"{what}: class names repeat: {classes[:20]}")
        if not (isinstance(size, int) and not isinstance(size, bool) and 8 <= size <= 8192):
            raise SpecError(f"{what}: image_size must be an integer in [8, 8192], got {size!r}")
        norm = {}
        for k in ("mean", "std"):
            v = rec.get(k)
            if not (isinstance(v, list) and len(v) == 3 and all(_number(x) for x in v)):
                raise SpecError(f"{what}: {k} must be 3 numbers (one per RGB channel), got {v!r}")
            norm[k] = [float(x) for x in v]
        if any(s <= 0 for s in norm["std"]):
            raise SpecError(f"{what}: std must be positive, got {norm['std']}")
        task = rec.get("task")
        if task is not None:
            check_node(task, f"{what}: task node", nested=True)
        resize = rec.get("resize_size")
        if resize is not None and not (
            isinstance(resize, int) and not isinstance(resize, bool) and size <= resize <= 8192
        ):
            raise SpecError(
                f"{what}: resize_size must be an integer in [image_size, 8192] or null, got {resize!r}"
            )
        return cls(node, list(classes), size, norm["mean"], norm["std"], task, resize)

    def build(self, allow: tuple[str, ...] = (), what: str = "the model record") -> nn.Module:
        """The model of this spec with fresh weights (num_classes = len(classes)), on CPU. Every
        `_target_` in the node is checked first (see the module docstring); `allow`: more dotted
        names to accept. A constructor that raises on the record's arguments (a negative width, an
        argument it does not take) is a SpecError naming `what` (the step dir or file) and the call."""
        from hydra.utils import instantiate

        node = self.node
        fns = {t: _buildable(t, allow) for t in _targets(node)}
        legacy = sorted(k for k in _keys(node) if k.startswith("pretrained"))
        if legacy:  # torchvision still maps pretrained=True to its default weights
            raise SpecError(f"model node: {', '.join(legacy)} refused (the checkpoint holds the weights)")
        # The checkpoint holds the weights: download nothing. Every `weights*` argument is None, named
        # or not: detection and segmentation builders default `weights_backbone` to ImageNet's.
        node = _no_weights(node, fns)
        target = node["_target_"]
        try:
            model = instantiate(node, num_classes=self.num_classes)
        except Exception as e:  # Hydra's InstantiationException, its cause the constructor's error
            cause = e.__cause__ or e
            raise SpecError(
                f"{what}: its model {self.call()} cannot be built: {type(cause).__name__}: {one_line(cause)}"
            ) from None
        if not isinstance(model, nn.Module):
            raise SpecError(f"model _target_ {target!r} returned a {type(model).__name__}, not an nn.Module")
        return model

    def build_task(self, allow: tuple[str, ...] = ()):
        """The task of this spec (goodput.recipe.task): its `_target_` a Task subclass, its loss an
        nn.Module class; DEFAULT_TASK for a record from before the task was recorded."""
        from hydra.utils import get_object, instantiate

        from goodput.recipe.task import Task

        node = self.task or DEFAULT_TASK
        try:
            cls = get_object(node["_target_"])
        except Exception as e:
            raise SpecError(f"task _target_ {node['_target_']!r} cannot be imported here: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise SpecError(
                f"task _target_ {node['_target_']!r} is not a goodput.recipe.task.Task: not calling it"
            )
        for t in _targets(node)[1:]:
            _buildable(t, allow)
        try:
            return instantiate(node)
        except Exception as e:
            cause = e.__cause__ or e
            raise SpecError(
                f"task record {_short(node)}: {type(cause).__name__}: {str(cause)[:300]}"
            ) from None

    def call(self) -> str:
        """The call the record makes, for a message: `_target_(argument=value, ..., num_classes=N)`."""
        node = {**self.node, "num_classes": self.num_classes}
        args = ", ".join(f"{k}={v!r}" for k, v in node.items() if k != "_target_")
        return f"{self.node['_target_']}({args if len(args) <= 300 else args[:300] + ' ...'})"

    def transform(self):
        """The eval view of an image (uint8 C x H x W): resize, center crop, normalize, as in training."""
        return augment.eval_transform(self.image_size, self.mean, self.std, self.resize_size)

    def preprocess(self, img: torch.Tensor) -> torch.Tensor:
        return self.transform()(img)


def _buildable(target: str, allow: tuple[str, ...] = ()):
    """The object `target` names, when a record may call it: an nn.Module class or a builder in
    BUILDERS (goodput's own functions are not: one could write files where the record says)."""
    from hydra.utils import get_object

    try:
        fn = get_object(target)
    except Exception as e:
        raise SpecError(f"model _target_ {target!r} cannot be imported here: {e}") from None
    module = getattr(fn, "__module__", "") or ""
    is_module_class = isinstance(fn, type) and issubclass(fn, nn.Module)
    is_builder = (
        not isinstance(fn, type)
        and callable(fn)
        and f"{module}.".startswith(tuple(f"{b}." for b in BUILDERS))
    )
    if not (is_module_class or is_builder or target in allow):
        raise SpecError(
            f"model _target_ {target!r} is neither an nn.Module class nor a builder in "
            f"{' / '.join(BUILDERS)}: not calling it from a record "
            f"(--allow-target {target} if you trust it)"
        )
    return fn


def _targets(node) -> list[str]:
    """Every `_target_` in a node, the top one first."""
    out = []
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            out.append(node["_target_"])
        for k, v in node.items():
            if k != "_target_":
                out += _targets(v)
    elif isinstance(node, list):
        for v in node:
            out += _targets(v)
    return out


def _keys(node) -> list[str]:
    if isinstance(node, dict):
        return [k for k, v in node.items() for k in [k, *_keys(v)]]
    if isinstance(node, list):
        return [k for v in node for k in _keys(v)]
    return []


def _no_weights(node, fns: dict):
    """A copy of `node` with every `weights*` argument None, in each `_target_` node, named or in
    its builder's signature (so nothing is downloaded)."""
    if isinstance(node, list):
        return [_no_weights(v, fns) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _no_weights(v, fns) for k, v in node.items()}
    if "_target_" in out:
        for k in [*out, *_parameters(fns.get(out["_target_"]))]:
            if k.startswith("weights"):
                out[k] = None
    return out


def _short(node) -> str:
    return json.dumps(node, default=str)[:200]


def one_line(e: BaseException, limit: int = 400) -> str:
    """An exception's message on one line (torch's and Hydra's span several), at most `limit` chars."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else f"{text[:limit]} ..."


def _parameters(fn) -> list[str]:
    if fn is None:
        return []
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or a class without a Python signature
        return []


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def check_node(node: object, what: str, nested: bool = False) -> dict:
    """A `_target_` node from a record: a dotted `_target_` and plain JSON values as arguments, with
    no key starting with `_` below it (`_args_`, `_partial_`, `_recursive_` change what is called).
    `nested`: arguments may be nodes with a dotted `_target_` of their own (instantiated too: the
    caller checks each one), and nothing else starting with `_`."""
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
        raise SpecError(f"{what} must be an object with a _target_ string, got {str(node)[:200]}")
    parts = node["_target_"].split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise SpecError(f"{what}: _target_ {node['_target_']!r} is not a dotted name")

    def walk(v, path):
        if isinstance(v, dict):
            for k, x in v.items():
                if nested and k == "_target_" and path:
                    if not (isinstance(x, str) and all(p.isidentifier() for p in x.split(".")) and "." in x):
                        raise SpecError(f"{what}: {path}_target_ {str(x)[:100]!r} is not a dotted name")
                    continue
                if not isinstance(k, str) or k.startswith("_"):
                    raise SpecError(f"{what}: key {path}{k} is refused (no Hydra instructions in a record)")
                walk(x, f"{path}{k}.")
        elif isinstance(v, list):
            for x in v:
                walk(x, path)
        elif not (v is None or isinstance(v, str | bool | int | float)):
            raise SpecError(f"{what}: {path} holds a {type(v).__name__}")

    walk({k: v for k, v in node.items() if k != "_target_"}, "")
    return node
