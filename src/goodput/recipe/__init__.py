"""The recipe: what a researcher reads and edits. Everything else is the engine.

    task.py      what is learned from a batch: targets, the loss (`task.loss`, any `_target_`), the
                 evaluation's metrics (which the monitors and the search may watch), what predict
                 writes. `task=classification` (default) and `task=multilabel`.
    metrics.py   the evaluations' sums and figures (exact on any number of ranks)
    batch.py     transforms of a whole delivered batch (`batch_augment=mixup|cutmix|mixup_cutmix`)
    models.py    the models, each with its shard plan (the blocks FSDP wraps one by one)
    params.py    the optimizer's parameter groups, from named parameters
    datasets.py  dataset classes of your own (`data.dataset._target_`)

The engine below keeps its promises for whatever is written here, with one contract each way:

- Randomness. Per sample, torch's, NumPy's and Python's global generators are seeded from
  (seed, epoch, index) around the augmentation; per step, around a batch transform, from
  (seed, step). Code that draws from them is exact on resume, at any worker count. A private
  generator must take its seed from the same numbers (`goodput.data.sampler.sample_seed`, or the
  `seed` a batch transform is called with), never from the clock or a counter.
- State. The checkpoint holds the model's parameters and buffers, the optimizer, the step's
  counters and everything the engine registered. A Python attribute that changes while training
  (a counter in `forward`) is not saved: keep such state in a buffer (`register_buffer`).
- Code. A commit records the digest of this package and of conf/; the same command after an edit is
  refused rather than continued (docs/recipe.md). After an edit, `make check` kills and resumes a
  short run of your config and names the first state that differs, if one does.
"""
