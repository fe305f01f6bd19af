"""Layer 5: one rank's training (the worker, its loop, recovery and evaluation); no Ray, and nothing of the
driver.

The layers and what each folder holds: docs/layout.md."""
