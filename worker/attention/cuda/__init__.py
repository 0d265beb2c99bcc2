"""The CUDA kernels' instantiation table and planner, run through CuPy on a GPU or in the CPU
emulator."""
