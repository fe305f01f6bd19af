"""Layer 3: one run's folder in storage (storage, metrics and events files, checkpoints, the lease, goodput,
quarantine); imports core and spec.

The layers and what each folder holds: docs/layout.md."""
