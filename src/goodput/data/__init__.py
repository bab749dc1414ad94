"""Data: sources (remote / cached), the pure-function sample order, the resumable loader."""
