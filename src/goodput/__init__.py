"""goodput: a PyTorch training template built around the share of accelerator time spent on useful work."""
