"""Layer 2: the job's description (config dataclasses, their validation, schedules, the Task interface, the
config reference); imports core.

The layers and what each folder holds: docs/layout.md."""
