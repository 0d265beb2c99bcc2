"""The front-end's side of LoRA: the registered adapters, checked before the engine loads them."""
