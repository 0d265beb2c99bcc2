"""Model building blocks: tensor-parallel linear layers, vocabulary embedding and LM head, norms,
rotary embedding, activations, and the weight methods their weights come from (quantization/)."""
