"""Tensor parallelism between a worker's ranks: the group and its collectives."""
