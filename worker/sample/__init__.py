"""Logits to tokens: per-step sampling metadata, logits processors and the sampler."""
