"""What a checkpoint holds, as one state dict of tensors only.

Layout (FQNs after DCP flattening):
    model.*            model weights (sharded under FSDP for DCP; full for torch_save); its
                       buffers written from rank 0 (AppState.buffer_keys)
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
    _get_fqns,
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


def _streams(torch_state: torch.Tensor, np_state: tuple, py_state: tuple) -> dict:
    """The saved form of the three generators' states (JSON-able)."""
    return {
        "torch": _b64(torch_state),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def step_seed(seed: int, rank: int, step: int) -> int:
    """The seed of `rank`'s random streams for the step after `step`: a pure function, so any rank's
    streams at any step boundary are known without its state (a rescue written by one survivor
    resumes every rank; a rank a checkpoint did not have starts exactly as the others would)."""
    from goodput.data.sampler import sample_seed

    return sample_seed(seed, -1 - rank, step) & 0xFFFFFFFF


class RNGState:
    """torch / CUDA / numpy / python RNG states of this rank. `at_step` reseeds all of them from
    (seed, rank, step) before every step, so the state at a step boundary is a pure function of it;
    the saved states say where the streams stood (and a resume sets them, then the next step reseeds)."""

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank = seed, rank

    def at_step(self, step: int) -> None:
        """Before the step after `step` draws anything (dropout, a random layer): seed every stream."""
        s = step_seed(self.seed, self.rank, step)
        torch.manual_seed(s)  # CUDA's generators too
        np.random.seed(s)
        random.seed(s)

    def state_dict(self) -> dict:
        sd = _streams(torch.get_rng_state(), np.random.get_state(), random.getstate())
        if torch.cuda.is_available():
            sd["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
        return sd

    def derived(self, rank: int, step: int) -> dict:
        """`rank`'s state dict at the boundary after `step`, as `at_step` leaves it: what a rescue
        writes for the ranks it speaks for. Computed without touching this process's streams."""
        s = step_seed(self.seed, rank, step)
        sd = _streams(
            torch.Generator().manual_seed(s).get_state(), np.random.RandomState(s).get_state(),
            random.Random(s).getstate(),
        )  # fmt: skip
        if torch.cuda.is_available():  # what manual_seed(s) gives each device's generator
            cuda = torch.Generator(device="cuda").manual_seed(s).get_state()
            sd["cuda"] = [_b64(cuda)] * torch.cuda.device_count()
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
        """A rank the checkpoint did not have: its streams as at_step leaves them at `step`."""
        self.at_step(step)
        log.info("rank %d: no saved RNG state (the checkpoint had fewer ranks), derived", self.rank)


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

    def buffer_keys(self) -> frozenset[str]:
        """The checkpoint keys (flattened: `model.<fqn>`, `<module>.<fqn>`) of the model's and the
        registered modules' buffers. Every rank holds them whole, but not equal: DDP broadcasts rank
        0's buffers at each forward, then each rank updates its copy with its own batch (BatchNorm's
        statistics), so at a step boundary the value the next step uses is rank 0's. A checkpoint
        writes them from rank 0 (the DCP backends' planner), as torch_save and model_sha256 do."""
        groups = {"model": self.model, **self.modules}
        return frozenset(
            f"{group}.{fqn}"
            for group, m in groups.items()
            for name, _ in m.named_buffers()
            for fqn in _get_fqns(m, name)
        )

    def _module_sds(self, options: StateDictOptions) -> dict:
        return {k: get_model_state_dict(m, options=options) for k, m in self.modules.items()}

    def state_dict(
        self, options: StateDictOptions, parts: dict | None = None, rank_parts: dict[int, dict] | None = None
    ) -> dict:
        """`parts`: global parts' states to write instead of asking them (a rescue's boundary state);
        `rank_parts`: rank -> its per-rank parts, instead of this rank's own (a rescue speaks for
        every rank at its shard position)."""
        parts = parts or {}
        if rank_parts is None:
            rank_parts = {self.rank: {k: p.state_dict() for k, p in self.rank_parts.items()}}
        msd, osd = get_state_dict(self.model, self.optimizer, options=options)
        # (full_state_dict with cpu_offload gives ranks other than 0 empty dicts: nothing to save there)
        sd = {
            "model": msd,
            "optim": {"state": osd.get("state", {})},
            **self._module_sds(options),
            "extra": {
                PARAM_GROUPS: encode(osd.get(PARAM_GROUPS, [])),
                **{k: encode(parts[k] if k in parts else p.state_dict()) for k, p in self.parts.items()},
            },
            **{f"rank{r}": {k: encode(v) for k, v in states.items()} for r, states in rank_parts.items()},
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
