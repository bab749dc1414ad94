"""Imported first by the forkserver the elastic workers are forked from (see launch.preload_forkserver).

A preemption signal goes to the whole process group, and the forkserver is in it: killed by it, the
forkserver could no longer report its children's exit codes (the agent would read 255 and treat
the orderly stop as a failure). It ignores these signals; it ends when the job process does (its
pipe closes). Workers forked from it inherit SIG_IGN until the loop installs its own handlers.
"""

import signal

from goodput.resilience.signals import PREEMPT_SIGNALS

for _sig in PREEMPT_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
