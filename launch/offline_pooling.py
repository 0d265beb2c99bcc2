"""`LLM`'s pooling calls (vLLM's `encode`, `embed`, `classify`, `score`), for an engine
started with `--runner pooling`: prompts are validated first, then run as one batch through
the same scheduler as generation (prefill only), results in prompt order."""
from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm import tqdm

from launch.errors import EngineDeadError
from launch.metrics.stats import IterationStats
from launch.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    as_classification,
    as_embedding,
)
from launch.processing.input_processor import PromptType, one_per_prompt
from launch.processing.pooling import GENERATE_ONLY, PooledInput
from launch.processing.pooling_state import POOLING_SAMPLING, PoolingRequestState
from launch.processing.scoring import plan_scoring
from protocol import PoolingParams


class PoolingMixin:
    """Needs `inputs`, `engine`, `output_processor`, `tokenizer`, `_lock` and `_ids`."""

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               use_tqdm: bool = True, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None,
               ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The pooler's raw output for each prompt (`pooling_task`: embed, classify,
        token_embed or token_classify; None: the parameters' task, else the model's)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = one_per_prompt(pooling_params, len(prompts), "pooling_params", PoolingParams,
                                "pooling parameter sets")
        inputs = self.inputs.process_pooling_many(prompts, params, pooling_task, True,
                                                  truncate_prompt_tokens)
        return self._run_pooling(inputs, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`)."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed",
                           truncate_prompt_tokens=truncate_prompt_tokens)
        return [as_embedding(out) for out in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """The classifier's outputs per prompt (`outputs.probs`)."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="classify",
                           truncate_prompt_tokens=truncate_prompt_tokens)
        return [as_classification(out) for out in outs]

    def score(self, data_1: str | list[str], data_2: str | list[str], /, *,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """A score per pair (1:1, 1:N or N:N): the cosine of the embeddings for an embedding
        model, the classifier's output on the pair for a one-label classifier."""
        if self.inputs.pooling is None:
            raise ValueError(GENERATE_ONLY)
        plan = plan_scoring(self.inputs.pooling, self.tokenizer, data_1, data_2)
        outs = self.encode(plan.prompts, pooling_params, use_tqdm=use_tqdm,
                           pooling_task=plan.task, truncate_prompt_tokens=truncate_prompt_tokens)
        failed = next((out for out in outs if out.error is not None), None)
        if failed is not None:
            raise ValueError(f"scoring failed in the engine: {failed.error}")
        scores = plan.scores([out.outputs.data for out in outs])
        pairs = outs if plan.task == "classify" else outs[plan.num_first:]
        return [PoolingRequestOutput(out.request_id, ScoringOutput(score),
                                     out.prompt_token_ids, True, out.num_cached_tokens,
                                     out.prompt) for out, score in zip(pairs, scores)]

    def _run_pooling(self, inputs: list[PooledInput], use_tqdm: bool,
                     ) -> list[PoolingRequestOutput[PoolingOutput]]:
        with self._lock:
            progress = tqdm(total=len(inputs), desc="Processed prompts", unit="req",
                            disable=not use_tqdm, dynamic_ncols=True)
            now = time.time()
            states = [PoolingRequestState.of(str(next(self._ids)), p, now) for p in inputs]
            batch = [self.inputs.make_request(state.request_id, p.prompt_token_ids,
                                              POOLING_SAMPLING, now, pooling_params=p.params)
                     for state, p in zip(states, inputs)]
            self.engine.add_requests(batch, [1] * len(batch))
            for state in states:
                self.output_processor.add_request(state)
            try:
                while self.output_processor.has_unfinished():
                    stats = IterationStats(time.time())
                    result = self.output_processor.process_outputs(self.engine.get_outputs(),
                                                                   stats)
                    progress.update(len(result.finished))
            except (KeyboardInterrupt, EngineDeadError):
                self.engine.abort_requests(self.output_processor.abort_all())
                raise
            finally:
                progress.close()
        return [state.output() for state in states]
