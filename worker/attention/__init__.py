"""Paged attention: the backend interface, its per-step metadata, one selector and the backends
(torch, native CPU, CUDA)."""
