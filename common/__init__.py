"""Low-level helpers shared by every process package (`launch`, `engine_core`, `worker`):
starting, naming, watching and stopping processes. Imports nothing of the project."""
