"""Speculative decoding in the engine core: n-gram proposals, draft scheduling, rollback."""
