"""The engine core's side of the workers: the group, its socket and failure reports."""
