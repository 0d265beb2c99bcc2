"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers import onednn_linear


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows `[r * V_r, (r + 1) * V_r)` of the table, V padded to a multiple of the
    group size; a lookup embeds the ids it owns, zeros the rest, and all-reduces."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.masked_fill(~owned, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(~owned.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab slice, gathered to the full (unpadded) vocab.

    Computed in float32 whatever the model dtype: a half-precision product rounds logits to
    8 (bf16) bits, which turns near-ties into exact ties and flips greedy tokens. A float32
    copy of the weight (packed for oneDNN on a CPU) is made on first use, when the weights are
    final; the embedding keeps the dense table, which a tied head shares."""

    weight_float32: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        if self.weight_float32 is None:
            weight = self.weight.detach().float()
            self.weight_float32 = (onednn_linear.pack(weight)
                                   if onednn_linear.enabled(weight.device) else weight)
        logits = self.tp.all_gather(onednn_linear.linear(hidden.float(), self.weight_float32))
        return logits[..., :self.vocab_size]
