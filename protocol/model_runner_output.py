"""What rank 0 returns to the scheduler after running one step."""
from __future__ import annotations

from protocol.draft_tokens import DraftTokens
from protocol.wire_struct import WireStruct


class SampleLogprobs(WireStruct):
    """Log-probabilities around one sampled token, from the model's raw distribution.

    `token_ids[0]` is the sampled token and `logprobs[0]` its log-probability; the rest are
    the top-n tokens in descending order. `rank` is the sampled token's 1-based rank.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class ModelRunnerOutput(WireStruct, tag=2):
    """New tokens per scheduled request, in `req_ids` order.

    `sampled_token_ids[i]` is empty for a prefill chunk that did not reach the end of the
    prompt; a request that verified d draft tokens gets 1 to d + 1 tokens (its accepted
    drafts, then the target's own token). `logprobs[i]` holds one entry per sampled token of
    request i when it asked for logprobs, else None; the whole column is None when no request
    asked. `draft_token_ids` are a draft model's proposals for the next step (None without).
    `pooler_output[i]` is pooling request i's result once its whole prompt has run (float32,
    little-endian), else None; the column is None in a step without results.
    """

    req_ids: list[int]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[SampleLogprobs] | None] | None = None
    step: int = 0
    draft_token_ids: DraftTokens | None = None
    pooler_output: list[bytes | None] | None = None

