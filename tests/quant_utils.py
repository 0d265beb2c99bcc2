"""Logits of whole prompts from a ModelRunner in this process (teacher forcing, one prefill),
for comparing weight methods and measuring perplexity."""
from __future__ import annotations

import math

import torch

from protocol import EngineConfig
from worker.attention.metadata import AttentionMetadata
from worker.model_runner import ModelRunner


def runner(model_dir: str, quantization: str, max_model_len: int = 256) -> ModelRunner:
    return ModelRunner(EngineConfig(model=model_dir, quantization=quantization,
                                    max_model_len=max_model_len, max_num_seqs=1,
                                    num_gpu_blocks_override=max_model_len // 16 + 2))


@torch.inference_mode()
def prompt_logits(r: ModelRunner, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), vocab]: row i predicts token i + 1 (blocks 1.. hold the KV)."""
    n, bs = len(ids), r.block_size
    blocks = torch.arange(1, -(-n // bs) + 1, dtype=torch.int32)
    positions = torch.arange(n)
    metadata = AttentionMetadata(
        slot_mapping=blocks[positions // bs].long() * bs + positions % bs,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_table=blocks[None],
        max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
    r.attention.plan(metadata)
    hidden = r.model(torch.tensor(ids), positions, r.kv_caches, metadata)
    return r.model.compute_logits(hidden)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1]."""
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)
