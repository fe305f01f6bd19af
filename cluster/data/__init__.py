"""Layer 4: the input pipeline (the resumable sampler, batches, Parquet); imports core, spec and run.

The layers and what each folder holds: docs/layout.md."""
