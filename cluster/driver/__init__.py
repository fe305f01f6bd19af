"""Layer 5: the run's state machine and its record; no Ray but through the worker group it is given, and
nothing of the ranks.

The layers and what each folder holds: docs/layout.md."""
