"""Issue 34's accuracy contract for the 8-bit-activation modes (`gguf_a8`, `w8a8`) in one
table, beside llama.cpp's own arithmetic on the same file. Not a timing: run it under the
heavy lock, not the bench lock.

Sections (--sections; both by default):
  ppl     perplexity of tests/test_gguf_a8_model.py's held-out texts. SmolLM2 (English):
          float32 (its Q4_1 file dequantized), gguf, gguf_a8, w8a8 and w8a8 without smoothing
          (on the file dequantized to a float32 directory), each with the mean KL divergence
          from float32's next-token distribution and the argmax agreement; llama.cpp's own
          perplexity on the Q4_1 file (its 8-bit activations) and on the same weights written
          as F32 (its float path). The demo model (Python): float32, w8a8 (its bf16
          checkpoint), gguf_a8 (written as a Q4_0/Q4_1/Q8_0 GGUF file) against that file's
          float32.
  greedy  32 chat prompts x 32 tokens (SmolLM2; the demo model knows no chat: 32 Python
          prompts), greedy through the engine, each mode against float32 of the same
          weights: prompts agreeing over all 32 tokens, the median agreed prefix, and the
          per-token argmax agreement along float32's continuations (teacher forcing), with
          p^32, what that rate gives a 32-token run (28 of 32 needs p^32 >= 0.875, p >=
          0.9958); llama.cpp's Q4_1 file against its F32 copy (--llamacpp-python).
Run: python benchmarks/bench_a8_accuracy.py [--sections ppl greedy]
     [--llamacpp-python /work/peer/llamacpp/bin/python]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
from _common import ROOT, Peer
from bench_quantized import _gguf_file, float32_dir

from launch import LLM, SamplingParams
from launch.model_cache.cache import download_model
from launch.processing.chat_template import ChatTemplate
from launch.processing.tokenizer import load_tokenizer
from protocol import EngineConfig
from worker.model_runner import ModelRunner

sys.path.insert(0, os.path.join(ROOT, "tests"))
from quant_utils import perplexity, prompt_logits  # noqa: E402
from test_gguf_a8_model import DEMO, ENGLISH, PYTHON, TOPICS, _agreed  # noqa: E402

TOKENS = 32


def _runner(model: str, mode: str, max_model_len: int = 512) -> ModelRunner:
    """`mode`: a quantization, `none` (float32) or `w8a8-raw` (w8a8, no smoothing)."""
    q = "w8a8" if mode == "w8a8-raw" else mode
    return ModelRunner(EngineConfig(
        model=model, quantization=q, dtype="float32" if q == "none" else "auto",
        max_model_len=max_model_len, max_num_seqs=1,
        num_gpu_blocks_override=max_model_len // 16 + 2, w8a8_smoothing=mode != "w8a8-raw"))


def f32_gguf(path: str) -> str:
    """A copy of the GGUF file at `path` with every tensor dequantized to F32 (llama.cpp's
    float path on the same weights), cached in the temporary directory."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    out = os.path.join(tempfile.gettempdir(), "deltaserve-bench-" +
                       os.path.basename(path).replace(".gguf", ".F32.gguf"))
    if os.path.isfile(out):
        return out
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out + ".part", reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        if field.name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(out + ".part", out)
    return out


def demo_gguf() -> str:
    """The demo model as a Q4_0/Q4_1/Q8_0 GGUF model directory (as its tests write it)."""
    from gguf_utils import write_gguf
    from safetensors.torch import load_file, save_file
    from test_gguf_a8_model import _demo_type

    from launch.model_cache.gguf_model import materialize_gguf
    root = os.path.join(tempfile.gettempdir(), "deltaserve-bench-demo-gguf")
    if not os.path.isdir(os.path.join(root, "dir")):
        shutil.rmtree(root, ignore_errors=True)
        hf = os.path.join(root, "hf")
        shutil.copytree(DEMO, hf)
        weights = os.path.join(hf, "model.safetensors")
        save_file({k: v.float().contiguous() for k, v in load_file(weights).items()}, weights)
        write_gguf(hf, os.path.join(root, "demo.gguf"), _demo_type)
        materialize_gguf(os.path.join(root, "demo.gguf"), os.path.join(root, "dir"))
    return os.path.join(root, "dir")


def _kl(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean KL(b || a) per position: b the float32 reference's logits."""
    lb, la = torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1)
    return (lb.exp() * (lb - la)).sum(-1).mean().item()


def ppl_rows(ids: list[int], runs: list[tuple[str, str, str]]) -> None:
    """runs: (label, model directory, mode); the first is the float32 reference."""
    logits = {label: prompt_logits(_runner(model, mode), ids) for label, model, mode in runs}
    ref_label = runs[0][0]
    ref = logits[ref_label]
    base = perplexity(ref, ids)
    for label, value in logits.items():
        ppl = perplexity(value, ids)
        agree = (value.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"  {label:24s} {ppl:8.4f} ({ppl / base - 1:+.2%}); KL from {ref_label} "
              f"{_kl(value, ref):.5f}; argmax agreement {agree:.1%}", flush=True)


def ppl_section(args, smollm2: str) -> None:
    dense = float32_dir(smollm2)
    ids = load_tokenizer(smollm2).encode(ENGLISH)
    print(f"perplexity, SmolLM2, {len(ids)} tokens of held-out English:")
    ppl_rows(ids, [("float32", smollm2, "none"), ("gguf (exact)", smollm2, "gguf"),
                   ("gguf_a8", smollm2, "gguf_a8"), ("w8a8", dense, "w8a8"),
                   ("w8a8, no smoothing", dense, "w8a8-raw")])
    if args.llamacpp_python:
        gguf_path = os.path.join(smollm2, _gguf_file(smollm2))
        peer = Peer(args.llamacpp_python, "_llamacpp_peer.py")
        for label, path in (("Q4_1 file (8-bit act.)", gguf_path),
                            ("F32 copy (float path)", f32_gguf(gguf_path))):
            value = peer.call("perplexity", model_path=path, ids=ids,
                              n_threads=args.threads)["perplexity"]
            print(f"  llama.cpp {label:24s} {value:8.4f}", flush=True)
        peer.close()
    ids = load_tokenizer(DEMO).encode(PYTHON)
    print(f"perplexity, demo model, {len(ids)} tokens of held-out Python:")
    ppl_rows(ids, [("float32", DEMO, "none"), ("w8a8", DEMO, "w8a8")])
    gguf_dir = demo_gguf()
    ppl_rows(ids, [("its GGUF file, float32", gguf_dir, "none"),
                   ("gguf_a8", gguf_dir, "gguf_a8")])


def _greedy(model: str, mode: str, prompts: list[str]) -> tuple[list, list]:
    q = "w8a8" if mode == "w8a8-raw" else mode
    engine = ({"dtype": "float32"} if q == "none" else
              {"quantization": q, "w8a8_smoothing": mode != "w8a8-raw"})
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model, max_model_len=256, num_gpu_blocks_override=160, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [list(o.prompt_token_ids)
                                                            for o in outs]


def _teacher_forced(model: str, mode: str, prompt_ids: list, reference: list) -> float:
    r = _runner(model, mode, 256)
    hits = total = 0
    for ids, cont in zip(prompt_ids, reference):
        pred = prompt_logits(r, ids + cont)[len(ids) - 1:len(ids) - 1 + len(cont)].argmax(-1)
        hits += (pred == torch.tensor(cont)).sum().item()
        total += len(cont)
    return hits / total


def _show(label: str, ours: list, ref: list, rate: float | None = None) -> None:
    p = sorted(_agreed(a, b) for a, b in zip(ours, ref))
    line = (f"  {label:34s} {sum(x == TOKENS for x in p):2d}/{len(p)} agree over {TOKENS} "
            f"tokens; median prefix {p[len(p) // 2]}; prefixes {p}")
    if rate is not None:
        line += f"; per-token agreement {rate:.4f}, ^{TOKENS} = {rate ** TOKENS:.3f}"
    print(line, flush=True)


def greedy_section(args, smollm2: str) -> None:
    template = ChatTemplate.from_model_dir(smollm2)
    chats = [template.render([{"role": "user", "content": f"Tell me about {t}."}])
             for t in TOPICS]
    names = [t.replace("the ", "").replace(" ", "_") for t in TOPICS]
    code = [f"def count_{n}(items):\n    \"\"\"Return how many {n} are in items.\"\"\"\n"
            for n in names]
    dense = float32_dir(smollm2)
    cases = [("SmolLM2", smollm2, chats, ["gguf", "gguf_a8"]),
             ("SmolLM2 dense", dense, chats, ["w8a8", "w8a8-raw"]),
             ("demo", DEMO, code, ["w8a8"]), ("demo GGUF", demo_gguf(), code, ["gguf_a8"])]
    print(f"greedy agreement with float32 of the same weights, {len(chats)} prompts x "
          f"{TOKENS} tokens:")
    for name, model, prompts, modes in cases:
        ref, prompt_ids = _greedy(model, "none", prompts)
        for mode in modes:
            ours, _ = _greedy(model, mode, prompts)
            _show(f"{name} {mode}", ours, ref, _teacher_forced(model, mode, prompt_ids, ref))
        if name == "SmolLM2" and args.llamacpp_python:
            gguf_path = os.path.join(smollm2, _gguf_file(smollm2))
            peer = Peer(args.llamacpp_python, "_llamacpp_peer.py")
            got = {label: peer.call("greedy", model_path=path, prompts=prompt_ids,
                                    max_tokens=TOKENS, n_threads=args.threads)["tokens"]
                   for label, path in (("q41", gguf_path), ("f32", f32_gguf(gguf_path)))}
            peer.close()
            _show("llama.cpp Q4_1 vs its F32 copy", got["q41"], got["f32"])
            _show("llama.cpp F32 copy vs our float32", got["f32"], ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", nargs="+", default=["ppl", "greedy"])
    parser.add_argument("--llamacpp-python", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()}")
    smollm2 = download_model("smollm2", progress=False)
    if "ppl" in args.sections:
        ppl_section(args, smollm2)
    if "greedy" in args.sections:
        greedy_section(args, smollm2)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
