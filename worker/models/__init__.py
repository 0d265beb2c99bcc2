"""Model architectures: a registry from `architectures[0]` to a model class, per-architecture
files, config adapters and the weight loader."""
