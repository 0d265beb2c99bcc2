"""vLLM's scoring routes: `POST /score` (also `/v1/score`) and `/rerank` (also `/v1/rerank`
and `/v2/rerank`, Jina's and Cohere's shape), on an embedding model (cosine of embeddings) or
a one-label classifier (a cross-encoder)."""
from __future__ import annotations

from typing import Any

from fastapi import Request, Response

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.pooling_protocol import RerankRequest, ScoreRequest
from launch.entrypoints.openai.protocol import read_body
from launch.entrypoints.openai.serving_pooling import OpenAIServingPooling
from launch.entrypoints.openai.streaming import json_response, now, request_id
from launch.processing.pooling import GENERATE_ONLY
from launch.processing.scoring import ScoringPlan, plan_scoring


class OpenAIServingScore:
    def __init__(self, pooling: OpenAIServingPooling) -> None:
        self.pooling = pooling

    async def score(self, raw: Request) -> Response:
        body = await read_body(raw, ScoreRequest)
        first, second = body.pair()
        rid = request_id("score")
        scores, tokens = await self._scores(raw, rid, body, first, second)
        return json_response({
            "id": rid, "object": "list", "created": now(), "model": self.pooling.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})

    async def rerank(self, raw: Request) -> Response:
        body = await read_body(raw, RerankRequest)
        query, documents = body.texts()
        rid = request_id("rerank")
        scores, tokens = await self._scores(raw, rid, body, query, documents)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[:body.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return json_response({"id": rid, "model": self.pooling.model_name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                              "results": results})

    async def _scores(self, raw: Request, rid: str, body: Any, first: Any, second: Any,
                      ) -> tuple[list[float], int]:
        pooling = self.pooling
        pooling.check_model(body.model)
        info = pooling.engine.inputs.pooling
        if info is None:
            raise APIError(400, GENERATE_ONLY)
        try:
            plan: ScoringPlan = await pooling.off_loop(
                lambda: plan_scoring(info, pooling.engine.tokenizer, first, second))
        except ValueError as e:
            raise APIError.bad_request(e) from None
        inputs = await pooling.prepare(body, plan.prompts, body.pooling_params(plan.task))
        outputs = await pooling.run(raw, rid, inputs, body.priority)
        scores = plan.scores([out.outputs.data for out in outputs])
        return scores, sum(len(p.prompt_token_ids) for p in inputs)
