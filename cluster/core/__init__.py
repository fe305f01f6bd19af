"""Layer 1: what every layer uses (errors, redaction, stacks, the event kinds, URL checks, heavy imports with
the GC paused); imports no other layer.

The layers and what each folder holds: docs/layout.md."""
