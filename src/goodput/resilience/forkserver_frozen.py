"""Imported last by the forkserver the elastic workers are forked from (see launch.preload_forkserver).

Its imports are done: gc.freeze() puts every object they made out of the collector's reach. The
workers forked from it then leave those pages shared (a collection would write to each object it
visits: copy-on-write), and the forkserver's exit skips walking them. Its exit had held the job's
output pipe open 2.3 s after the job's last line, 0.7 s with the freeze (docs/testing.md).
"""

import gc

gc.freeze()
