"""A draft model in the worker: a smaller model with the target's vocabulary proposes tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.draft_tokens import DraftTokens
from protocol.engine_config import EngineConfig
from protocol.int_column import IntColumn
from protocol.sampling_params import GREEDY_EPS
from worker.attention.backend import AttentionBackend
from worker.distributed.tensor_parallel import TensorParallel
from worker.input_batch import InputBatch, StepProtocolError, as_array
from worker.kv_cache import allocate_kv_cache
from worker.models.config import ModelConfig
from worker.models.loader import load_model
from worker.models.registry import load_model_config
from worker.sample.sampler import argmax
from worker.sample.spec_decode_metadata import SpecDecodeMetadata
from worker.step_inputs import StepInputs, attention_inputs


@dataclass(slots=True)
class _Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), vocab] what random sampling drew them from


def draft_model_config(config: EngineConfig) -> ModelConfig | None:
    """The draft model's config where speculative decoding proposes with one, else None."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return load_model_config(spec.model)


class DraftModelProposer:
    """Runs on every rank at the target's tensor-parallel size (so every rank holds the same
    proposals and draft probabilities, and rank 0 answers with them).

    Its KV cache is its own tensors over the target's block ids and block size: the
    scheduler's block tables serve both. After each target step it computes the tokens that
    step made known ([computed before the step, computed after the verification)), plus, for
    each request that proposes, its newest token, whose logits give the first draft; each
    further draft is one more single-token pass. Drafts' KV lands past the known tokens, in
    slots the scheduler reserves (its lookahead), and is rewritten once those tokens are
    known. Greedy requests propose the draft's argmax; random ones draw from its distribution
    at their temperature and keep it as q for the verification in the next step.
    """

    def __init__(self, draft_dir: str, draft: ModelConfig, target: ModelConfig,
                 dtype: torch.dtype, device: torch.device, tp: TensorParallel,
                 attention: AttentionBackend, max_model_len: int,
                 generator: torch.Generator) -> None:
        self.model_config = draft  # draft_dir's config
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {draft_dir!r} has a vocabulary of "
                             f"{self.model_config.vocab_size} tokens, the target "
                             f"{target.vocab_size}: they must share one vocabulary")
        self.model = load_model(draft_dir, self.model_config, dtype, device, tp, attention,
                                max_model_len)
        self.kv_cache_spec = self.model.kv_cache_spec()
        self.kv_caches: list = []
        self.attention = attention
        self.max_model_len = max_model_len
        self.generator = generator  # for random requests without a seed (every rank alike)
        self.pending: dict[int, _Proposal] = {}  # row -> proposals of the last step

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_cache_spec, num_blocks, block_size, device)

    def draft_probs(self, rows: np.ndarray, spec: SpecDecodeMetadata,
                    ) -> list[torch.Tensor | None]:
        """q of each verified request (rows in logits order); the scheduled drafts must be a
        prefix of what this proposer proposed for them in the last step."""
        probs = []
        cu = spec.cu_num_drafts.tolist()
        drafts = spec.draft_token_ids.tolist()
        for r, (row, n) in enumerate(zip(rows.tolist(), spec.num_draft_tokens.tolist())):
            proposal = self.pending.get(row)
            if n and (proposal is None or proposal.tokens[:n] != drafts[cu[r]:cu[r + 1]]):
                raise StepProtocolError("a step verifies drafts the draft model did not propose")
            probs.append(proposal.probs[:n] if n and proposal.probs is not None else None)
        return probs

    @torch.inference_mode()
    def propose(self, batch: InputBatch, step: StepInputs,
                num_to_propose: IntColumn | None) -> DraftTokens | None:
        """After the target's step (its tokens appended): catch up on what the step made
        known and propose `num_to_propose[i]` tokens (capped by slots) for request i."""
        rows = step.rows
        k = self._capped(batch, rows, num_to_propose) * step.sampled
        end = batch.num_computed[rows] + (k > 0)
        counts = end - step.computed
        positions, metadata = attention_inputs(batch, rows, step.computed, counts)
        input_ids = batch.token_ids[np.repeat(rows, counts), positions]
        hidden = self._forward(input_ids, positions, metadata, batch.device)
        proposing = np.flatnonzero(k > 0)
        self.pending = {}
        if not len(proposing):
            return None
        last = torch.from_numpy(np.cumsum(counts)[proposing] - 1).to(hidden.device)
        logits = self.model.compute_logits(hidden[last])
        drafts: list[list[int]] = [[] for _ in proposing]
        probs: list[list[torch.Tensor]] = [[] for _ in proposing]
        active = np.arange(len(proposing))
        for j in range(int(k.max())):
            chosen = self._choose(logits, batch, rows[proposing[active]], probs, active)
            for i, token in zip(active.tolist(), chosen):
                drafts[i].append(token)
            active = active[k[proposing[active]] > j + 1]
            if not len(active):
                break
            logits = self._next_logits(batch, rows[proposing[active]],
                                       [drafts[i][-1] for i in active.tolist()], j)
        for i, row in enumerate(rows[proposing].tolist()):
            self.pending[row] = _Proposal(drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return DraftTokens.from_lists([step.req_ids[p] for p in proposing.tolist()], drafts)

    def _capped(self, batch: InputBatch, rows: np.ndarray,
                num_to_propose: IntColumn | None) -> np.ndarray:
        """Drafts per request: as asked, within the slots its blocks have (draft j's KV goes
        to position num_tokens + j - 1) and below max_model_len."""
        if num_to_propose is None:
            return np.zeros(len(rows), np.int64)
        k = as_array(num_to_propose)
        room = np.minimum(batch.num_blocks[rows] * batch.block_size,
                          self.max_model_len) - batch.num_tokens[rows] + 1
        return np.clip(np.minimum(k, room), 0, None)

    def _next_logits(self, batch: InputBatch, rows: np.ndarray, tokens: list[int],
                     j: int) -> torch.Tensor:
        """One more pass: draft j (0-based) of each row, at position num_tokens + j."""
        start = batch.num_tokens[rows] + j
        positions, metadata = attention_inputs(batch, rows, start, np.ones(len(rows), np.int64))
        hidden = self._forward(np.asarray(tokens, np.int64), positions, metadata, batch.device)
        return self.model.compute_logits(hidden)

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, metadata,
                 device: torch.device) -> torch.Tensor:
        self.attention.plan(metadata)
        return self.model(torch.from_numpy(input_ids).to(device),
                          torch.from_numpy(positions).to(device), self.kv_caches, metadata)

    def _choose(self, logits: torch.Tensor, batch: InputBatch, rows: np.ndarray,
                probs: list[list[torch.Tensor]], active: np.ndarray) -> list[int]:
        """A draft token per row: the argmax for greedy requests; for random ones a draw from
        softmax(logits / temperature), recorded in `probs`."""
        tokens = argmax(logits).tolist()
        table = batch.sampling
        for i, row in enumerate(rows.tolist()):
            temperature = float(table.temperature[row])
            if temperature < GREEDY_EPS:
                continue
            q = torch.softmax(logits[i] / temperature, dim=-1)
            generator = table.generators[row] or self.generator
            tokens[i] = int(torch.multinomial(q, 1, generator=generator))
            probs[int(active[i])].append(q)
        return tokens
