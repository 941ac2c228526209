"""The task contract: `Task`, the target kinds, the framework adapters and the data pipeline.
Imports storage and base only; the loop reads the run being built through `task.current_run`."""
