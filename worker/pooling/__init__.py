"""The pooling side of the worker: poolers the model runner calls on a step's hidden states."""
