"""Speculative decoding in the worker: the draft model that proposes tokens."""
