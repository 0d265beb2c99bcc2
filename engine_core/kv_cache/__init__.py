"""The paged KV cache's bookkeeping: manager (prefix caching), block pool and free queue."""
