"""Kill drills of the training step's switches through the entry point, compared by the state
itself: the newest committed checkpoint's model, optimizer, EMA tensors, the scaler's state, the
schedule and the data position, read back from disk.

Few runs on purpose (each is a process start): the switches are on together, and one chain of
runs covers a kill between micro-steps on 2-rank DDP, its resume, a resume of the same checkpoint
on one process with the same global batch (accumulating twice as many micro-batches), a kill at a
step on one process and its resume."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FORGET_WEIGHTS, REPO, TRAIN, ckpt_dir, entry_env, latest_summary, run_train

pytestmark = pytest.mark.slow

ALL_ON = [
    "trainer.precision=16-mixed",
    "trainer.micro_batch_size=4",  # 2 micro-batches per rank on 2 ranks, 4 on one
    "trainer.clip_grad_norm=0.5",
    "trainer.ema_decay=0.9",
    "trainer.eval_on=ema",
    "trainer.channels_last=true",
    "checkpoint=dcp_sync",
    "checkpoint.every_n_steps=2",
]

# DDP on 2 ranks -> 1 process with the same global batch: the same micro-batches, the same loss
# weights, but the gradient sum associates differently ((a+b)+(c+d) over ranks, ((a+b)+c)+d in
# one process): float rounding, nothing else. Measured after 12 steps: largest relative difference
# of any checkpointed tensor (model, optimizer, EMA) 7.4e-08; a resume that loaded no weights (the
# negative control below) 1.9.
STATE_RTOL = 1e-6


def checkpoint_state(root) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, decoded extras) of the newest committed checkpoint of the smoke run under `root`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from goodput.checkpoint.backends import SafeFileSystemReader
    from goodput.checkpoint.layout import local_commits
    from goodput.checkpoint.state import decode

    newest = Path(local_commits(ckpt_dir(root))[-1][1])
    reader = SafeFileSystemReader(str(newest))
    md = reader.read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=reader, no_dist=True)
    tensors = {k: v for k, v in sd.items() if k.split(".")[0] in ("model", "optim", "ema")}
    extras = {k: decode(v) for k, v in sd.items() if k.split(".")[0] not in ("model", "optim", "ema")}
    return tensors, extras


def state_gap(got, want, same_world: bool) -> float:
    """Largest relative tensor difference; the scaler, schedule, data position (and with the same
    world size, every rank's RNG state) must be equal."""
    (gt, ge), (wt, we) = got, want
    assert gt.keys() == wt.keys()
    assert any(k.startswith("ema.module.") for k in wt) and "ema.n_averaged" in wt
    for k in ("extra.step", "extra.scheduler", "extra.param_groups"):
        assert ge[k] == we[k], k
    assert ge["extra.data"]["sample_order_sha256"] == we["extra.data"]["sample_order_sha256"]
    if same_world:
        assert {k: v for k, v in ge.items() if k.startswith("rank")} == {
            k: v for k, v in we.items() if k.startswith("rank")
        }
    return max(
        ((gt[k].double() - wt[k].double()).abs().max() / wt[k].double().abs().max().clamp(min=1e-12)).item()
        for k in wt
    )


def fired(root) -> list[str]:
    return sorted(p.name for p in (ckpt_dir(root) / "faults").glob("*.fired"))


def test_all_switches_kill_between_micro_steps_ddp_then_one_process(tmp_path):
    ref, a = tmp_path / "ref", tmp_path / "a"
    run_train(ref, "parallel=ddp", *ALL_ON)
    want = checkpoint_state(ref)
    assert want[1]["extra.step"]["scaler"]["_growth_tracker"] == 12  # fp16 was on, and the scaler ran

    # rank 0 dies between the two micro-batches of step 7; step 6 is the newest commit
    run_train(a, "parallel=ddp", *ALL_ON, "fault.kill_in_step=7", expect_rc=None)
    assert fired(a) == ["kill_in_step-7.fired"]
    b, c, d = tmp_path / "b", tmp_path / "c", tmp_path / "d"
    for copy in (b, c, d):
        shutil.copytree(a, copy, symlinks=True)

    _, s = run_train(a, "parallel=ddp", *ALL_ON, "fault.kill_in_step=7")
    assert s["resumed_from_steps"] == [6]
    assert state_gap(checkpoint_state(a), want, same_world=True) == 0.0  # bit-identical

    # The same checkpoint on one process, global batch 16 kept (4 micro-batches of 4): to the end
    # (d), and killed at step 9, after its own commit of step 8, then relaunched once more (b).
    _, s = run_train(d, "parallel=single", *ALL_ON)
    assert s["resumed_from_steps"] == [6]
    gap = state_gap(checkpoint_state(d), want, same_world=False)
    print(f"ddp 2 ranks -> 1 process with accumulation: largest relative state difference {gap:.2e}")
    assert gap < STATE_RTOL, gap
    run_train(b, "parallel=single", *ALL_ON, "fault.kill_at_step=9", expect_rc=-9)
    _, s = run_train(b, "parallel=single", *ALL_ON, "fault.kill_at_step=9")
    assert s["resumed_from_steps"] == [6, 8] and fired(b) == ["kill_at_step-9.fired", "kill_in_step-7.fired"]
    assert state_gap(checkpoint_state(b), checkpoint_state(d), same_world=True) == 0.0  # bit-identical

    # Negative control: the same 2 -> 1 resume, with the weights re-initialised after the restore.
    script = tmp_path / "forget_weights.py"
    script.write_text(FORGET_WEIGHTS)
    cmd = [
        sys.executable,
        str(script),
        TRAIN,
        "experiment=smoke",
        f"paths.root={c}",
        "parallel=single",
        *ALL_ON,
    ]
    p = subprocess.run(cmd, cwd=REPO, env=entry_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert latest_summary(c)["resumed_from_steps"] == [6]
    gap = state_gap(checkpoint_state(c), want, same_world=False)
    print(f"resume that loaded no weights: largest relative state difference {gap:.2e}")
    assert gap > 1000 * STATE_RTOL, gap


def test_fsdp_bf16_clip_ema_kill_and_relaunch(tmp_path):
    """FSDP2: bf16 parameters (MixedPrecisionPolicy), fp32 reduction, clipping over all shards,
    sharded EMA, accumulation with the gradient-sync switch, async DCP saves."""
    on = [
        "parallel=fsdp",
        "trainer.precision=bf16-mixed",
        "trainer.micro_batch_size=4",
        "trainer.clip_grad_norm=0.5",
        "trainer.ema_decay=0.9",
        "checkpoint=dcp_async",
        "checkpoint.every_n_steps=2",
    ]
    ref, a = tmp_path / "ref", tmp_path / "a"
    run_train(ref, *on)
    run_train(a, *on, "fault.kill_at_step=7", expect_rc=None)
    assert fired(a) == ["kill_at_step-7.fired"]
    _, s = run_train(a, *on, "fault.kill_at_step=7")
    assert s["resumed_from_steps"] in ([6], [4])  # step 6's async save may still be uploading
    assert state_gap(checkpoint_state(a), checkpoint_state(ref), same_world=True) == 0.0
