"""LoRA adapters in the workers: PEFT directories read and checked, the wrapped linear layers, each step's adapter rows and their batched deltas, and the adapters a worker keeps loaded."""
