"""Build, load and bind the C++ libraries of worker/kernels (compiled on first use, cached on
disk)."""
