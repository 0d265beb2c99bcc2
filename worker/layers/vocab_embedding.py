"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

import torch
from torch import nn

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.quantization.base import QuantizationConfig
from worker.layers.quantization.unquantized import UnquantizedConfig


class VocabParallelBase(nn.Module):
    """Rank r holds rows `[r * V_r, (r + 1) * V_r)` of a `[vocab, hidden]` table, V padded to a
    multiple of the group size (the padding rows stay zero)."""

    def __init__(self, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        dims = param.shard_dims
        dims.output(param.data, 0, rows).copy_(dims.output(loaded, self.vocab_start, rows))


class VocabParallelEmbedding(VocabParallelBase):
    """A lookup embeds the ids this rank owns, zeros the rest, and all-reduces."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(vocab_size, tp)
        config = quant_config or UnquantizedConfig()
        self.quant_method = config.get_embedding_method(self, prefix)
        self.quant_method.create_weights(self, hidden_size, self.rows_per_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.quant_method.embedding(self, input_ids)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.rows_per_rank)
        out = self.quant_method.embedding(self, local.masked_fill(~owned, 0))
        return self.tp.all_reduce(out.masked_fill(~owned.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelBase):
    """Logits for this rank's vocab slice, gathered to the full (unpadded) vocab, in float32
    whatever the compute dtype (the LM-head method's contract)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(vocab_size, tp)
        config = quant_config or UnquantizedConfig()
        self.quant_method = config.get_lm_head_method(self, prefix)
        self.quant_method.create_weights(self, hidden_size, self.rows_per_rank)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        logits = self.tp.all_gather(self.quant_method.apply(self, hidden))
        return logits[..., :self.vocab_size]
