"""The job's own build resumes what it registered, run in this process: EMA weights that differ
from the model's under every backend, and the worker's hang watchdog armed for the loop. Each fails
with the matching bug planted (an EMA lost or restored from the model, a watchdog never started).
(The early-stopping counter part-way to its patience: unit/test_checkpoint.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import run_job_here

from goodput.checkpoint import BACKENDS
from goodput.checkpoint.commits import Commits
from goodput.checkpoint.export import model_state
from goodput.storage.remote import Storage


def _weights(ckpt_dir: str, step: int, which: str) -> dict[str, torch.Tensor]:
    store = Storage(ckpt_dir)
    rec = next(r for r in Commits(store).committed() if r["step"] == step)
    return model_state(store, rec, which)


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_jobs_ema_resumes_under_every_backend(tmp_path, one_process, backend):
    """The job's EMA (registered by its build, not by the test) is saved and restored: a run resumed
    from its step-3 commit ends with the EMA weights of the run that went straight to step 6, and
    those differ from the model's (an EMA lost at the resume, or restored from the model, fails)."""
    keys = ("trainer.ema_decay=0.5", f"checkpoint={backend}", "trainer.max_steps=6",
            "checkpoint.every_n_steps=3", "checkpoint.keep_last=3", "mlflow.log_model=none")  # fmt: skip
    first, _ = run_job_here(tmp_path, *keys)
    ckpt = first["checkpoint_dir"]
    ema, model = _weights(ckpt, 6, "ema"), _weights(ckpt, 6, "model")
    assert any(not torch.equal(ema[k], model[k]) for k in model)  # the EMA is not the model
    again, _ = run_job_here(tmp_path, *keys, f"run.resume={ckpt}/step-000000003", run_dir=tmp_path / "again")
    assert again["resumed_from_steps"][-1] == 3 and again["steps"] == 6
    resumed = _weights(ckpt, 6, "ema")
    assert resumed.keys() == ema.keys()
    for k, v in ema.items():
        assert torch.equal(resumed[k], v), k


def test_the_worker_arms_the_hang_watchdog_for_the_loop(tmp_path, one_process, monkeypatch):
    """When the loop starts, the rank's hang watchdog runs (its thread alive, the configured bound):
    a worker that never started it would let a hung rank hold the allocation forever."""
    from goodput.run import loop

    seen = {}
    train = loop.train

    def watched(t):
        th = t.watchdog._thread
        seen.update(alive=th is not None and th.is_alive(), timeout=t.watchdog.timeout_s)
        return train(t)

    monkeypatch.setattr(loop, "train", watched)
    run_job_here(tmp_path, "trainer.max_steps=2", "trainer.hang_timeout_s=123", "mlflow.log_model=none")
    assert seen == {"alive": True, "timeout": 123}


def test_the_worker_starts_the_loader_before_the_restore(tmp_path, one_process, monkeypatch):
    """A start puts the batches of the step it will most likely resume at in flight before the
    checkpoint is read (docs/goodput.md, what keeps a restart short): step 0 with nothing to resume,
    the commit's step on a resume, and the loop reads from that very iterator (the restore kept it)."""
    from goodput.data.loader import ResumableLoader
    from goodput.run import loop

    seen: list = []
    start_at, train = ResumableLoader.start_at, loop.train

    def spy(self, step):
        start_at(self, step)
        seen.append({"ahead": step, "restored_yet": self.step, "it": self._it})

    def watched(t):
        seen.append({"loop_it": t.loader._it})
        return train(t)

    monkeypatch.setattr(ResumableLoader, "start_at", spy)
    monkeypatch.setattr(loop, "train", watched)
    keys = ("checkpoint=dcp_sync", "trainer.max_steps=6", "checkpoint.every_n_steps=3", "data.num_workers=1",
            "mlflow.log_model=none")  # fmt: skip
    first, _ = run_job_here(tmp_path, *keys)
    again, _ = run_job_here(
        tmp_path, *keys, f"run.resume={first['checkpoint_dir']}/step-000000003", run_dir=tmp_path / "again"
    )
    assert again["resumed_from_steps"][-1] == 3 and again["steps"] == 6
    assert [(s["ahead"], s["restored_yet"]) for s in seen[0::2]] == [(0, 0), (3, 0)]
    for ahead, loop_start in (seen[0:2], seen[2:4]):
        assert ahead["it"] is not None and loop_start["loop_it"] is ahead["it"]
