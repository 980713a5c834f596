"""Benchmarks: each prints a ratio of two runs made side by side in one script run."""
