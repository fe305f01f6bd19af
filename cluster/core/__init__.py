"""Layer 1: what every layer uses (errors, redaction, stacks, the event kinds); the standard library only.

The layers and what each folder holds: docs/layout.md."""
