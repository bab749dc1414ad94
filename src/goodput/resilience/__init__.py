"""Keeping a run alive and its losses counted: signals, faults, run lock, ledger, recovery record."""
