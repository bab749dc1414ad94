"""Exceptions raised in one layer and handled in another (the data loader raises, the checkpoint
manager and the entry point handle): here, so neither imports the other for a class."""


class UserError(Exception):
    """Something the user's config, data or store got wrong, said in full by its message (it names
    the file, entry or key): scripts/train.py prints it as one line and exits 2, no traceback. A
    subclass keeps its own base too (DataRootError is a FileNotFoundError), so handlers that catch
    that base still do."""


class IncompatibleCheckpoint(UserError, RuntimeError):
    """An intact checkpoint that cannot continue this run (the dataset changed, another seed or
    global batch size): an error to show, never a reason to fall back or start fresh."""
