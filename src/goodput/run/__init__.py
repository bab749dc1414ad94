"""The run, phase by phase: job (once per job), launch, worker, build (components), loop."""
