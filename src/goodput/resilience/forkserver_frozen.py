"""Imported last by the forkserver the elastic workers are forked from (see launch.preload_forkserver).

Its imports are done: gc.freeze() puts every object they made out of the collector's reach. The
workers forked from it then leave those pages shared (a collection would write to each object it
visits: copy-on-write), and the forkserver's exit skips walking them: 1.3 s of its last 1.5 s here,
during which the job's output pipe stayed open (docs/testing.md).
"""

import gc

gc.freeze()
