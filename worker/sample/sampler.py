"""Turns logits into tokens: penalties, min_tokens, greedy or temperature/top-k/top-p/min-p
sampling with per-request seeds, and top-n logprobs.

Every rank of a tensor-parallel group sees identical logits and identical generator states and
runs this same code, so all ranks sample the same tokens without communicating.
"""
from __future__ import annotations

import numpy as np
import torch

from protocol.model_runner_output import SampleLogprobs
from protocol.sampling_params import GREEDY_EPS, SamplingParams
from worker.input_batch import InputBatch


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        # Draws for requests without their own seed; every rank advances it identically.
        self.generator = torch.Generator(device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, batch: InputBatch, rows: np.ndarray,
               ) -> tuple[list[int], list[SampleLogprobs | None] | None]:
        """logits: [len(rows), vocab] float32 for the batch rows `rows` -> one token per row,
        plus logprobs when any row asked for them."""
        table = batch.sampling
        want_logprobs = table.logprobs[rows]
        raw = torch.log_softmax(logits, dim=-1) if (want_logprobs >= 0).any() else None
        logits = self._adjust(logits, batch, rows)
        temperature = table.temperature[rows]
        tokens = logits.argmax(dim=-1)
        random = np.flatnonzero(temperature >= GREEDY_EPS)
        if len(random):
            tokens[random] = self._sample_random(logits[random], batch, rows[random])
        token_list = tokens.tolist()
        if raw is None:
            return token_list, None
        return token_list, [_logprobs(raw[i], token_list[i], int(n)) if n >= 0 else None
                            for i, n in enumerate(want_logprobs)]

    def _adjust(self, logits: torch.Tensor, batch: InputBatch, rows: np.ndarray) -> torch.Tensor:
        """Penalties, and stop tokens suppressed below min_tokens: only rows that need it."""
        table = batch.sampling
        num_outputs = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
        special = np.flatnonzero(table.penalties[rows] | (num_outputs < table.min_tokens[rows]))
        if not len(special):
            return logits
        logits = logits.clone()
        for i in special:
            row = int(rows[i])
            prompt, output = batch.prompt_and_output(row)
            if table.penalties[row]:
                apply_penalties(logits[i], table.params[row], prompt, output)
            if len(output) < table.min_tokens[row]:
                stops = [t for t in table.stop_tokens(row) if t < logits.shape[-1]]
                logits[i, stops] = float("-inf")
        return logits

    def _sample_random(self, logits: torch.Tensor, batch: InputBatch,
                       rows: np.ndarray) -> torch.Tensor:
        table = batch.sampling
        logits = logits / torch.from_numpy(table.temperature[rows]).to(logits.device)[:, None]
        logits = apply_top_k_top_p_min_p(logits, table.top_k[rows], table.top_p[rows],
                                         table.min_p[rows])
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p. Seeded requests
        # draw from their own generator, so their tokens do not depend on the batch.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            generator = table.generators[row]
            if generator is not None:
                noise[i].exponential_(generator=generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: np.ndarray,
                    output: np.ndarray) -> None:
    """vLLM's semantics: repetition over prompt and output tokens (divide positive logits,
    multiply negative ones), presence and frequency over output tokens only."""
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.from_numpy(output.astype(np.int64)),
                            minlength=vocab)[:vocab].to(logits)
    if params.repetition_penalty != 1.0:
        in_prompt = torch.bincount(torch.from_numpy(prompt.astype(np.int64)),
                                   minlength=vocab)[:vocab] > 0
        seen = in_prompt.to(logits.device) | (counts > 0)
        penalized = torch.where(logits > 0, logits / params.repetition_penalty,
                                logits * params.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray,
                            min_p: np.ndarray) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k (0: off), then outside its top-p
    nucleus, then below min_p times its most likely token's probability. Rows: [n, vocab]."""
    vocab = logits.shape[-1]
    k = torch.from_numpy(np.where((top_k > 0) & (top_k < vocab), top_k, vocab)).to(logits.device)
    p = torch.from_numpy(np.asarray(top_p, np.float32)).to(logits)
    if bool((k < vocab).any()) or bool((p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if (np.asarray(min_p) > 0).any():
        probs = torch.softmax(logits, dim=-1)
        floor = torch.from_numpy(np.asarray(min_p, np.float32)).to(logits)[:, None]
        logits = logits.masked_fill(probs < floor * probs.max(-1, keepdim=True).values,
                                    float("-inf"))
    return logits


def _logprobs(logprobs: torch.Tensor, token: int, n: int) -> SampleLogprobs:
    top = torch.topk(logprobs, min(n, logprobs.shape[-1])) if n > 0 else None
    chosen = float(logprobs[token])
    rank = int((logprobs > chosen).sum()) + 1
    ids = [token] + (top.indices.tolist() if top is not None else [])
    values = [chosen] + (top.values.tolist() if top is not None else [])
    return SampleLogprobs(ids, values, rank)
