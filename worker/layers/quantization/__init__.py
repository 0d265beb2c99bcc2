"""Weight methods: how each linear, embedding and LM-head layer creates, finishes and applies its
weights (dense today; quantized formats plug in as further configs)."""
