"""Layer 7: the entry points (``train``, ``submit``, loading and exporting checkpoints, rewind, dry runs, the
embedded Ray).

The layers and what each folder holds: docs/layout.md."""
