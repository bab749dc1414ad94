"""Exceptions raised in one layer and handled in another (the data loader raises, the checkpoint
manager and the entry point handle): here, so neither imports the other for a class."""


class IncompatibleCheckpoint(RuntimeError):
    """An intact checkpoint that cannot continue this run (the dataset changed, another seed or
    global batch size): an error to show, never a reason to fall back or start fresh."""
