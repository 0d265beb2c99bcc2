"""Verifying draft tokens against the target model: speculative sampling (Leviathan et al.,
arXiv 2211.17192), exact for greedy and distribution-preserving for random sampling."""
from __future__ import annotations

import numpy as np
import torch

from protocol.model_runner_output import SampleLogprobs
from protocol.sampling_params import GREEDY_EPS
from worker.sample.metadata import SamplingMetadata
from worker.sample.sampler import Sampler, argmax, probabilities, sample_logprobs
from worker.sample.spec_decode_metadata import SpecDecodeMetadata


class RejectionSampler:
    """Turns a speculative step's logits into each request's tokens: its accepted drafts, then
    one token of the target's own (a bonus token when every draft was accepted).

    The logits go through the sampler's logits processors first, each row with its request's
    drafts before it counted as outputs (penalties, min_tokens), so every accepted position
    sees what a plain step would have seen there.
    * Greedy: drafts are accepted while each equals the target's argmax; then the argmax is
      emitted. The tokens are exactly those of plain greedy decoding.
    * Random: draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the
      first rejection a token is drawn from max(p_j - q_j, 0), renormalized; with every draft
      accepted, the bonus token is drawn from p_d. p is what the plain sampler draws from
      (temperature, top-k, top-p, min-p, grammar masks at every position), q the draft
      model's distribution or, for n-gram drafts and constrained requests, a point mass on x_j.
      The emitted tokens are distributed as the target's.
      A request draws its uniforms, then one exponential race, from its own generator when
      seeded (else the sampler's), so results are reproducible and the same on every rank.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 spec: SpecDecodeMetadata,
                 ) -> tuple[list[list[int]], list[list[SampleLogprobs] | None] | None]:
        """logits: [spec.num_logits, vocab] float32; metadata row i describes logits row i.
        -> tokens per request (1 to d + 1 each), and their logprobs where asked."""
        raw = torch.log_softmax(logits, dim=-1) if (metadata.logprobs >= 0).any() else None
        for processor in self.sampler.processors:
            logits = processor.apply(logits, metadata)
        starts = spec.logits_start
        argmax_tokens = argmax(logits).cpu().numpy()
        tokens = _verify_greedy(argmax_tokens, spec, starts)
        if not metadata.all_greedy:
            drafts = spec.draft_token_ids.tolist()
            cu = spec.cu_num_drafts.tolist()
            point_mass = _constrained(metadata, starts)
            for r in np.flatnonzero(metadata.temperature[starts] >= GREEDY_EPS).tolist():
                q = spec.draft_probs[r] if spec.draft_probs is not None and \
                    not point_mass[r] else None
                tokens[r] = self._verify_random(logits, metadata, int(starts[r]),
                                                drafts[cu[r]:cu[r + 1]], q)
        if raw is None:
            return tokens, None
        return tokens, [[sample_logprobs(raw[start + j], t, int(n)) for j, t in enumerate(ts)]
                        if n >= 0 else None
                        for start, ts, n in zip(starts.tolist(), tokens,
                                                metadata.logprobs[starts])]

    def _verify_random(self, logits: torch.Tensor, metadata: SamplingMetadata, start: int,
                       drafts: list[int], q: torch.Tensor | None) -> list[int]:
        """One request: logits rows [start, start + len(drafts)], q [d, vocab] or None."""
        d = len(drafts)
        rows = np.arange(start, start + d + 1)
        p = probabilities(logits[start:start + d + 1], metadata, rows)
        generator = metadata.generators.get(start, self.sampler.generator)
        accepted = d
        if d:
            index = torch.arange(d, device=p.device)
            draft = torch.tensor(drafts, device=p.device)
            p_draft = p[index, draft]
            q_draft = q[index, draft] if q is not None else torch.ones_like(p_draft)
            uniform = torch.rand(d, generator=generator, device=p.device)
            rejected = torch.nonzero(uniform * q_draft >= p_draft)
            accepted = int(rejected[0, 0]) if len(rejected) else d
        if accepted < d:
            residual = p[accepted] - q[accepted] if q is not None else p[accepted].clone()
            if q is None:
                residual[drafts[accepted]] = 0.0
            residual.clamp_(min=0.0)
            if not float(residual.sum()) > 0.0:  # p == q up to rounding: any draw from p
                residual = p[accepted]
        else:
            residual = p[d]
        noise = torch.empty_like(residual).exponential_(generator=generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return drafts[:accepted] + [int((residual / noise).argmax())]


def _constrained(metadata: SamplingMetadata, starts: np.ndarray) -> np.ndarray:
    """[R] bool: request r is constrained. Its drafts were cut where its grammar refused
    one, so they are not draws from the draft model's q: they are verified as point masses
    (q = 1 on the draft), which keeps the target's distribution whatever chose them."""
    if metadata.grammar_rows is None:
        return np.zeros(len(starts), bool)
    return np.isin(starts, metadata.grammar_rows)


def _verify_greedy(argmax: np.ndarray, spec: SpecDecodeMetadata,
                   starts: np.ndarray) -> list[list[int]]:
    """Per request: the argmax tokens of its rows up to and including its first row whose
    draft differs from the argmax (all rows when none does)."""
    d = spec.num_draft_tokens
    accepted = d.copy()
    if len(spec.draft_token_ids):
        owner = np.repeat(np.arange(len(d)), d)
        j = np.arange(len(spec.draft_token_ids)) - np.repeat(spec.cu_num_drafts[:-1], d)
        miss = np.flatnonzero(argmax[starts[owner] + j] != spec.draft_token_ids)
        np.minimum.at(accepted, owner[miss], j[miss])
    values = argmax.tolist()
    return [values[s:s + a + 1] for s, a in zip(starts.tolist(), accepted.tolist())]
