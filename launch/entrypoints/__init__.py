"""Network entrypoints on `AsyncLLM`."""
