"""Turns logits into tokens: penalties, min_tokens, greedy or temperature/top-k/top-p/min-p
sampling with per-request seeds, and top-n logprobs.

Every rank of a tensor-parallel group sees identical logits and identical generator states and
runs this same code, so all ranks sample the same tokens without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.model_runner_output import SampleLogprobs
from worker.input_batch import InputBatch, RequestState


@dataclass(slots=True)
class SamplingRow:
    state: RequestState
    prompt: np.ndarray  # prompt token ids
    output: np.ndarray  # output token ids so far


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        # Draws for requests without their own seed; every rank advances it identically.
        self.generator = torch.Generator(device).manual_seed(seed)

    def rows(self, batch: InputBatch, rows: np.ndarray) -> list[SamplingRow]:
        return [SamplingRow(batch.states[r], *batch.prompt_and_output(int(r))) for r in rows]

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               ) -> tuple[list[int], list[SampleLogprobs | None] | None]:
        """logits: [num_rows, vocab] float32 -> one token per row (+ logprobs if asked)."""
        params = [row.state.sampling_params for row in rows]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.state.sampling_params.needs_penalties:
                apply_penalties(logits[i], row)
            _suppress_stops_before_min_tokens(logits[i], row)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            random_rows = (~greedy).nonzero().flatten()
            drawn = self._sample_random(logits[random_rows], [rows[i] for i in random_rows])
            tokens[random_rows] = drawn
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, None
        return token_list, [_logprobs(raw_logprobs[i], token_list[i], p.logprobs)
                            if p.logprobs is not None else None for i, p in enumerate(params)]

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [row.state.sampling_params for row in rows]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature.unsqueeze(1)
        logits = apply_top_k_top_p_min_p(logits, [p.top_k for p in params],
                                         [p.top_p for p in params], [p.min_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p. Seeded requests
        # draw from their own generator, so their tokens do not depend on the batch.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.state.generator is not None:
                noise[i].exponential_(generator=row.state.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """vLLM's semantics: repetition over prompt and output tokens (divide positive logits,
    multiply negative ones), presence and frequency over output tokens only."""
    p = row.state.sampling_params
    vocab = logits.shape[-1]
    output = torch.from_numpy(row.output.astype(np.int64)).to(logits.device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
    if p.repetition_penalty != 1.0:
        prompt = torch.from_numpy(row.prompt.astype(np.int64)).to(logits.device)
        seen = (torch.bincount(prompt, minlength=vocab)[:vocab] > 0) | (counts > 0)
        penalized = torch.where(logits > 0, logits / p.repetition_penalty,
                                logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _suppress_stops_before_min_tokens(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.state.sampling_params
    if len(row.output) >= p.min_tokens:
        return
    stops = list(p.stop_token_ids or ())
    if row.state.eos_token_id is not None and not p.ignore_eos:
        stops.append(row.state.eos_token_id)
    stops = [t for t in stops if t < logits.shape[-1]]
    if stops:
        logits[stops] = float("-inf")


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                            min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k, then outside its top-p nucleus,
    then below min_p times its most likely token's probability. Rows: [n, vocab]."""
    vocab = logits.shape[-1]
    k = torch.tensor([t if t > 0 else vocab for t in top_k], device=logits.device)
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
    if bool((k < vocab).any()) or bool((p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        drop = ranks[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = torch.tensor(min_p, device=logits.device)[:, None] * probs.max(-1, True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _logprobs(logprobs: torch.Tensor, token: int, n: int) -> SampleLogprobs:
    top = torch.topk(logprobs, min(n, logprobs.shape[-1])) if n > 0 else None
    chosen = float(logprobs[token])
    rank = int((logprobs > chosen).sum()) + 1
    ids = [token] + (top.indices.tolist() if top is not None else [])
    values = [chosen] + (top.values.tolist() if top is not None else [])
    return SampleLogprobs(ids, values, rank)
