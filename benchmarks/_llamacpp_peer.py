"""The llama.cpp side of bench_quantized.py: a long-lived process run by a Python that has
llama-cpp-python (never the project's venv), driven by `_common.Peer` with one JSON object
per line (replies on the original stdout; llama.cpp's own output goes to stderr). Ops:
  init {model_path, n_ctx, n_threads}     -> {version, system_info}
  chat {messages, max_tokens}             -> {seconds, tokens}   (one create_chat_completion,
                                             greedy, end-of-generation tokens banned so all
                                             max_tokens come, KV state reset first)
  perplexity {model_path, ids, n_threads} -> {perplexity}       (a second Llama with all logits:
                                             exp of the mean NLL of ids[1:])
  prompts {prompts: [[token ids]]}        -> {seconds, tokens}   (each prompt evaluated from an
                                             empty KV state: prompt processing only)
  quit
"""
from __future__ import annotations

import time

from _peer_loop import serve

STATE: dict = {}


def init(model_path: str, n_ctx: int, n_threads: int) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    STATE["llm"] = llm
    STATE["bias"] = {t: -1e9 for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    return {"version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def chat(messages: list[dict], max_tokens: int) -> dict:
    llm = STATE["llm"]
    llm.reset()
    start = time.perf_counter()
    reply = llm.create_chat_completion(messages=messages, max_tokens=max_tokens,
                                       temperature=0.0, logit_bias=STATE["bias"])
    return {"seconds": time.perf_counter() - start,
            "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["message"]["content"]}


def prompts(prompts: list[list[int]]) -> dict:
    llm = STATE["llm"]
    seconds = 0.0
    for ids in prompts:
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        seconds += time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(ids) for ids in prompts)}


def perplexity(model_path: str, ids: list[int], n_threads: int) -> dict:
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=len(ids) + 16, n_batch=len(ids) + 16,
                          n_threads=n_threads, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
    logits -= logits.max(-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -logprobs[np.arange(len(ids) - 1), ids[1:]].mean()
    return {"perplexity": float(np.exp(nll))}


OPS = {"init": init, "chat": chat, "prompts": prompts, "perplexity": perplexity}


def main() -> None:
    serve(OPS)


if __name__ == "__main__":
    main()
