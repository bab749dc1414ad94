"""Issue #22's S3 target through the real entry point: a 2-rank DDP job with its data and its
dcp_async checkpoints on moto's S3 server finishes, and each commit lands within 1 s of the last
rank's manifest (the server's own timestamps of the objects)."""

from __future__ import annotations

import threading
import time
from datetime import UTC

import pytest
from helpers import run_train

from goodput.data.synthetic import make_dataset


def landed(bucket: str) -> dict[str, float]:
    """Key -> the moto server's creation time (epoch seconds, microsecond resolution) of every
    manifest and commit record in `bucket` (the server runs in this process)."""
    from moto.s3.models import s3_backends

    out = {}
    for account in list(s3_backends.values()):
        for backend in list(account.values()):
            b = backend.buckets.get(bucket)
            for key, obj in list(b.keys.items()) if b is not None else []:
                if key.endswith("/COMMIT.json") or "/ranks/" in key:
                    out[key] = obj.last_modified.replace(tzinfo=UTC).timestamp()
    return out


@pytest.mark.slow
@pytest.mark.serial  # commit within 1 s of the last manifest
def test_two_rank_s3_job_commits_within_a_second_of_the_last_manifest(tmp_path, s3_bucket, s3_endpoint):
    import s3fs

    data = tmp_path / "data"  # the smoke job's demo data (10 classes x 20, 16 px), uploaded
    make_dataset(str(data), 10, 20, 4, 16, 0)
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).put(
        str(data), f"{s3_bucket}/data", recursive=True
    )
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch():  # retention deletes old step dirs: record each object as it appears
        while not stop.is_set():
            for k, t in landed(s3_bucket).items():
                seen.setdefault(k, t)
            time.sleep(0.05)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        _, s = run_train(
            tmp_path / "root", "parallel=ddp", "checkpoint=dcp_async", "checkpoint.every_n_steps=3",
            f"data.root=s3://{s3_bucket}/data", f"paths.checkpoint_dir=s3://{s3_bucket}/ckpt",
            "parallel.max_restarts=0", "checkpoint.commit_timeout_s=60", timeout=240,
        )  # fmt: skip
    finally:
        stop.set()
        th.join()
    seen.update(landed(s3_bucket))
    assert s["restarts"] == 0 and s["steps"] == 12
    steps = {}
    for key, t in seen.items():
        step_dir = next(part for part in key.split("/") if part.startswith("step-"))
        steps.setdefault(step_dir, {})[key.rsplit("/", 1)[1]] = t
    assert sorted(steps) == [f"step-{n:09d}" for n in (3, 6, 9, 12)], sorted(steps)
    for step_dir, objs in steps.items():
        assert {"0.json", "1.json", "COMMIT.json"} <= set(objs), (step_dir, objs)
        gap = objs["COMMIT.json"] - max(objs["0.json"], objs["1.json"])
        assert 0 <= gap < 1.0, (step_dir, gap)
