"""What a checkpoint holds, as one state dict of tensors only.

Layout (FQNs after DCP flattening):
    model.*            model weights (sharded under FSDP for DCP; full for torch_save)
    <module>.*         other modules' tensors registered with `register_module` (the EMA weights:
                       `ema.module.*`, `ema.n_averaged`), sharded and loaded in place like the model
    optim.state.*      optimizer state tensors, FQN-keyed (resharding-safe)
    extra.param_groups the optimizer's param_groups (lr, betas, FQNs, ...): JSON in a uint8 tensor
    extra.<name>       global Stateful parts (data position, scheduler, ledger, ...): JSON in a uint8 tensor
    rank<r>.<name>     per-rank Stateful parts (RNG states): rank-indexed, because DCP de-duplicates
                       equal keys across ranks and would hand rank 0's value to every rank.

Everything is a tensor on purpose: DCP stores non-tensors as pickled BYTE_IO and loads them with
`torch.load(weights_only=False)`. `get_state_dict` returns the optimizer's param_groups as plain Python
values, which would be exactly such entries, so they travel as JSON instead. With tensors only,
loading never unpickles code (and the reader refuses BYTE_IO entries outright).
"""

from __future__ import annotations

import base64
import json
import logging
import random
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from goodput.untrusted import RecordError

log = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...


def encode(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def decode(t: torch.Tensor):
    return json.loads(bytes(t.to(torch.uint8).cpu().numpy().tobytes()).decode())


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


class RNGState:
    """torch / CUDA / numpy / python RNG states of this rank. Missing on a new rank: derived."""

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank = seed, rank

    def state_dict(self) -> dict:
        np_state = np.random.get_state()
        sd = {
            "torch": _b64(torch.get_rng_state()),
            "numpy": [
                np_state[0],
                np_state[1].tolist(),
                int(np_state[2]),
                int(np_state[3]),
                float(np_state[4]),
            ],
            "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        }
        if torch.cuda.is_available():
            sd["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
        return sd

    def load_state_dict(self, sd: dict) -> None:
        torch.set_rng_state(_unb64(sd["torch"]))
        n = sd["numpy"]
        np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
        p = sd["python"]
        random.setstate((p[0], tuple(p[1]), p[2]))
        if "cuda" in sd and torch.cuda.is_available():
            states = [_unb64(s) for s in sd["cuda"]]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)

    def derive(self, step: int) -> None:
        """A rank the checkpoint did not have: seed deterministically from (seed, rank, step)."""
        from goodput.data.sampler import sample_seed

        s = sample_seed(self.seed, -1 - self.rank, step) & 0xFFFFFFFF
        torch.manual_seed(s)
        np.random.seed(s)
        random.seed(s)
        log.warning(
            "rank %d has no saved RNG state (checkpoint had fewer ranks): derived from seed %d", self.rank, s
        )


PARAM_GROUPS = "param_groups"
# A global part's template value when a checkpoint may lack it (goodput.checkpoint.backends skips it
# then): one written by an older goodput, before the part existed.
OPTIONAL = "optional"


def _tensors_only(tree, path: str) -> None:
    """A non-tensor leaf would be saved as a pickled BYTE_IO entry: refuse it when saving, by name."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            _tensors_only(v, f"{path}.{k}")
    elif not torch.is_tensor(tree):
        raise TypeError(
            f"checkpoint entry {path} is a {type(tree).__name__}, not a tensor: only tensors are saved "
            f"(non-tensors would be pickled, and unpickling on load can run code)"
        )


def _restore_tuples(saved: list[dict], live: list[dict]) -> list[dict]:
    """JSON turns tuples (Adam's betas) into lists: give values back the type the optimizer made."""
    out = []
    for g_saved, g_live in zip(saved, live):
        g = dict(g_saved)
        for k, v in g_live.items():
            if isinstance(v, tuple) and isinstance(g.get(k), list):
                g[k] = tuple(g[k])
        out.append(g)
    return out


class AppState:
    """The registry a checkpoint saves and restores: model, optimizer, and named Stateful parts."""

    def __init__(self, model, optimizer, rank: int):
        self.model, self.optimizer, self.rank = model, optimizer, rank
        self.parts: dict[str, Stateful] = {}  # global: identical on every rank
        self.rank_parts: dict[str, Stateful] = {}  # per rank
        self.modules: dict[str, torch.nn.Module] = {}  # tensor groups beside the model (EMA)
        self.optional: dict[str, str] = {}  # global part -> what resuming without it means

    def register(self, name: str, part: Stateful, per_rank: bool = False, missing: str | None = None) -> None:
        """`missing`: the part may be absent from a checkpoint (one written before the part existed);
        the text says what resuming without it means, and is logged as a warning. None: required."""
        if name == PARAM_GROUPS:
            raise ValueError(f"{name!r} is reserved for the optimizer's param_groups")
        (self.rank_parts if per_rank else self.parts)[name] = part
        if missing is not None and not per_rank:
            self.optional[name] = missing

    def register_module(self, name: str, module: torch.nn.Module) -> None:
        """A module whose tensors are saved as group `name`, like the model's (sharded under FSDP,
        gathered for torch_save) and loaded into it in place, so they reshard with the model."""
        if name in ("model", "optim", "extra") or name.startswith("rank"):
            raise ValueError(f"{name!r} is a reserved checkpoint group")
        self.modules[name] = module

    def _module_sds(self, options: StateDictOptions) -> dict:
        return {k: get_model_state_dict(m, options=options) for k, m in self.modules.items()}

    def state_dict(self, options: StateDictOptions) -> dict:
        msd, osd = get_state_dict(self.model, self.optimizer, options=options)
        # (full_state_dict with cpu_offload gives ranks other than 0 empty dicts: nothing to save there)
        sd = {
            "model": msd,
            "optim": {"state": osd.get("state", {})},
            **self._module_sds(options),
            "extra": {
                PARAM_GROUPS: encode(osd.get(PARAM_GROUPS, [])),
                **{k: encode(p.state_dict()) for k, p in self.parts.items()},
            },
            f"rank{self.rank}": {k: encode(p.state_dict()) for k, p in self.rank_parts.items()},
        }
        _tensors_only(sd, "")
        return sd

    def template(self, options: StateDictOptions, saved_world: int, saved_parts: list | None = None) -> dict:
        """What to load into: live model/optim tensors; None where sizes come from the checkpoint.
        `saved_parts`: the global parts the commit record lists (an optional part it lacks is left out)."""
        msd, osd = get_state_dict(self.model, self.optimizer, options=options)
        parts = [k for k in self.parts if k not in self.optional or k in (saved_parts or ())]
        sd = {
            "model": msd,
            "optim": {"state": osd.get("state", {})},
            **self._module_sds(options),
            "extra": {k: OPTIONAL if k in self.optional else None for k in [PARAM_GROUPS, *parts]},
        }
        if self.rank < saved_world:
            sd[f"rank{self.rank}"] = dict.fromkeys(self.rank_parts)
        return sd

    def apply(self, sd: dict, options: StateDictOptions, step: int) -> None:
        live_groups = self.optimizer.state_dict()[PARAM_GROUPS]
        groups = _restore_tuples(decode(sd["extra"][PARAM_GROUPS]), live_groups)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=sd["model"],
            optim_state_dict={"state": sd["optim"]["state"], PARAM_GROUPS: groups},
            options=options,
        )
        for k, m in self.modules.items():
            if k in sd:
                set_model_state_dict(m, sd[k], options=options)
            else:  # the EMA's first update then copies the restored weights, as at a fresh start
                log.warning("the checkpoint has no %r: it starts from this run's initial state", k)
        for k, p in self.parts.items():
            if k in self.optional and sd["extra"].get(k) is None:  # switched on later, or an older goodput
                why = self.optional[k]
                log.warning("the checkpoint has no %r (step %d; on since, or older): %s", k, step, why)
                continue
            if k not in sd["extra"]:
                raise KeyError(f"the checkpoint has no entry extra.{k}")
            try:
                p.load_state_dict(decode(sd["extra"][k]))
            except RecordError as e:  # a part that may be missing may be malformed: it starts over
                if k not in self.optional:
                    raise
                log.warning("the checkpoint of step %d: %s; %s", step, e, self.optional[k])
        mine = sd.get(f"rank{self.rank}")
        for k, p in self.rank_parts.items():
            if mine is not None:
                p.load_state_dict(decode(mine[k]))
            elif hasattr(p, "derive"):
                p.derive(step)
