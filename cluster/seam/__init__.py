"""Layer 4: the seam between the driver and the ranks (the ``WorkerGroup`` protocol and the types it carries);
imports core, spec and run.

The layers and what each folder holds: docs/layout.md."""
