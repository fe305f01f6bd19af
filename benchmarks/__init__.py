"""Benchmarks: commands that measure the product against bare PyTorch DDP and Ray Train (not tests)."""
