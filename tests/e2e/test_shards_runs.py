"""`data=shards` on the entry point: the demo data generated, packed on first use, trained."""

from __future__ import annotations

import pytest

from goodput.data.shards import INDEX


@pytest.mark.slow  # one real entry-point run: demo data generated, packed on first use, trained
def test_train_entry_point_with_data_shards(tmp_path):
    from helpers import run_train

    _, s = run_train(tmp_path, "data=shards", "data.source.shuffle_block=2")
    assert s is not None and s["steps"] > 0
    packed = list(tmp_path.rglob(INDEX))
    assert len(packed) == 1 and packed[0].parent.name.endswith("-shards")
