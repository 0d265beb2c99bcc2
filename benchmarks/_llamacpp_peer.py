"""The llama.cpp side of bench_quantized.py: a long-lived process run by a Python that has
llama-cpp-python (never the project's venv), driven by `_common.Peer` with one JSON object
per line (replies on the original stdout; llama.cpp's own output goes to stderr). Ops:
  init {model_path, n_ctx, n_threads}     -> {version, system_info}
  chat {messages, max_tokens}             -> {seconds, tokens}   (one create_chat_completion,
                                             greedy, end-of-generation tokens banned so all
                                             max_tokens come, KV state reset first)
  complete {prompt, max_tokens}           -> {seconds, tokens, text}   (create_completion,
                                             likewise: a base model's plain completion)
  batch {prompts, max_tokens}             -> {seconds, tokens}   (token-id prompts decoded
                                             together, one sequence each in one context
                                             (its batch API, as llama.cpp's `batched`
                                             example), greedy, all max_tokens; the context
                                             is made on first use and cleared each call)
  perplexity {model_path, ids, n_threads} -> {perplexity}       (a second Llama with all logits:
                                             exp of the mean NLL of ids[1:])
  prompts {prompts: [[token ids]]}        -> {seconds, tokens}   (each prompt evaluated from an
                                             empty KV state: prompt processing only)
  greedy {model_path, prompts: [[ids]], max_tokens, n_threads} -> {tokens: [[ids]]}
                                             (a second Llama, f32 KV: each prompt's argmax
                                             continuation, no stop tokens)
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
    STATE["llm"], STATE["n_threads"] = llm, n_threads
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


def _batch_context(n_seq: int, n_ctx: int):
    """A second context on the same model for `batch`, with room for n_seq sequences."""
    import llama_cpp
    key = (n_seq, n_ctx)
    if STATE.get("batch_key") != key:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_ctx, 512
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = STATE["n_threads"]
        STATE["batch_ctx"] = llama_cpp.llama_init_from_model(STATE["llm"].model, params)
        STATE["batch_key"] = key
    return STATE["batch_ctx"]


def batch(prompts: list[list[int]], max_tokens: int) -> dict:
    import llama_cpp
    import numpy as np
    n_seq = len(prompts)
    n_ctx = n_seq * (max(map(len, prompts)) + max_tokens + 8)
    ctx = _batch_context(n_seq, n_ctx)
    vocab = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(STATE["llm"].model))
    banned = np.array(sorted(STATE["bias"]), dtype=np.int64)
    start = time.perf_counter()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    b = llama_cpp.llama_batch_init(n_ctx, 0, 1)
    # (sequence, token, position, wants logits) rows: the prompts, then one token each
    rows = [(s, t, i, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
    positions = [len(p) for p in prompts]
    generated = 0
    try:
        for _ in range(max_tokens):
            b.n_tokens = len(rows)
            for n, (s, t, pos, wants) in enumerate(rows):
                b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = t, pos, 1, wants
                b.seq_id[n][0] = s
            if llama_cpp.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            outputs = [n for n, row in enumerate(rows) if row[3]]
            nxt = []
            for s, n in enumerate(outputs):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, n),
                                               shape=(vocab,)).copy()
                logits[banned] = -np.inf
                nxt.append((s, int(logits.argmax()), positions[s], True))
                positions[s] += 1
            generated += len(nxt)
            rows = nxt
    finally:
        llama_cpp.llama_batch_free(b)
    return {"seconds": time.perf_counter() - start, "tokens": generated}


def complete(prompt: str, max_tokens: int) -> dict:
    llm = STATE["llm"]
    llm.reset()
    start = time.perf_counter()
    reply = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0,
                                  logit_bias=STATE["bias"])
    return {"seconds": time.perf_counter() - start,
            "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["text"]}


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


def greedy(model_path: str, prompts: list[list[int]], max_tokens: int, n_threads: int) -> dict:
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=max(map(len, prompts)) + max_tokens + 8,
                          n_threads=n_threads, type_k=0, type_v=0, logits_all=True,
                          verbose=False)
    outs = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        tokens: list[int] = []
        for _ in range(max_tokens):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        outs.append(tokens)
    return {"tokens": outs}


OPS = {"init": init, "chat": chat, "complete": complete, "batch": batch, "prompts": prompts,
       "perplexity": perplexity, "greedy": greedy}


def main() -> None:
    serve(OPS)


if __name__ == "__main__":
    main()
