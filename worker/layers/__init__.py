"""Model building blocks: tensor-parallel linear layers, vocabulary embedding and LM head, norms,
rotary embedding, activations."""
