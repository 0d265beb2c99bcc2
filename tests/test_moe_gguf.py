"""Mixture-of-experts GGUF files as llama.cpp writes them (Qwen3-MoE `qwen3moe`, Qwen2-MoE
`qwen2moe`, Mixtral as `llama` with experts): stacked `*_exps` tensors kept in their blocks
and multiplied by the fused MoE kernel give the dequantized model's logits; the dequantized
model equals Hugging Face transformers run on the same (dequantized) weights; TP 2 keeps the
blocks and the greedy tokens."""
from __future__ import annotations

import json
import os
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf_utils import write_moe_gguf
from model_utils import CORPUS, assert_greedy_matches, hf_greedy, make_tiny_model
from quant_utils import prompt_logits, runner

from launch import LLM, SamplingParams
from launch.model_cache.gguf_model import materialize_gguf
from launch.processing.tokenizer import load_tokenizer
from worker.layers.quantization.gguf import GGUFFusedMoEMethod

Q = gguf.GGMLQuantizationType
# arch -> (HF architecture, GGUF architecture, model overrides, type of each tensor by
# projection; None: float32). Qwen3-MoE uses K-quants (rows of 256), the others 32-blocks,
# Qwen2-MoE with gate and up of different types (and a shared expert TP 2 can split in whole
# blocks).
CASES = {
    "qwen3_moe": ("qwen3moe", {"hidden_size": 256, "moe_intermediate_size": 256,
                               "intermediate_size": 512},
                  {"gate_proj": Q.Q4_K, "up_proj": Q.Q4_K, "down_proj": Q.Q6_K,
                   "q_proj": Q.Q8_0, "k_proj": Q.Q8_0, "v_proj": Q.Q8_0, "o_proj": Q.Q8_0}),
    "qwen2_moe": ("qwen2moe", {"shared_expert_intermediate_size": 128},
                  {"gate_proj": Q.Q8_0, "up_proj": Q.Q4_1, "down_proj": Q.Q5_0,
                                   "q_proj": Q.Q8_0, "embed_tokens": Q.Q8_0}),
    "mixtral": ("llama", {}, {"gate_proj": Q.Q4_0, "up_proj": Q.Q4_0, "down_proj": Q.Q8_0,
                              "k_proj": Q.Q5_1}),
}


def _files(arch: str, root) -> tuple[str, str]:
    """(GGUF model directory, HF directory holding the GGUF's dequantized weights)."""
    gguf_arch, overrides, types = CASES[arch]
    hf = make_tiny_model(str(root / "hf"), arch, tokenizer=True, **overrides)
    expected = write_moe_gguf(hf, str(root / "m.gguf"), gguf_arch,
                              lambda name: types.get(name.rsplit(".", 2)[-2]))
    reference = _save_as_hf(hf, expected, str(root / "dequantized"), arch == "mixtral")
    return materialize_gguf(str(root / "m.gguf"), str(root / "dir")), reference


@pytest.fixture(scope="module", params=list(CASES))
def files(request, tmp_path_factory):
    return _files(request.param, tmp_path_factory.mktemp(request.param))


def _save_as_hf(hf_dir: str, tensors: dict[str, np.ndarray], out: str, mixtral: bool) -> str:
    """`tensors` (common names, experts stacked) under the HF checkpoint's names, beside a copy
    of its config and tokenizer."""
    from safetensors.torch import save_file
    shutil.copytree(hf_dir, out)
    names = {}
    for name, w in tensors.items():
        m = re.fullmatch(r"(.+\.experts)\.(\w+)\.weight", name)
        parts = {f"{m[1]}.{e}.{m[2]}.weight": w[e] for e in range(w.shape[0])} if m else {name: w}
        for part, value in parts.items():
            if mixtral:
                for old, new in ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."),
                                 (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
                    part = part.replace(old, new)
            names[part] = torch.from_numpy(np.ascontiguousarray(value))
    save_file(names, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def test_kept_experts_give_the_dequantized_logits_and_hf_agrees(files):
    model_dir, reference = files
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "gguf"
    kept = runner(model_dir, "auto")
    methods = [layer.mlp.experts.quant_method for layer in kept.model.model.layers
               if hasattr(layer.mlp, "experts")]
    assert methods and all(isinstance(m, GGUFFusedMoEMethod) for m in methods)
    assert all(layer.mlp.experts.fused_experts.is_native for layer in kept.model.model.layers
               if hasattr(layer.mlp, "experts"))
    assert kept.weights_summary.startswith("gguf (")
    ids = load_tokenizer(model_dir).encode(CORPUS[:300])
    a, b = prompt_logits(kept, ids), prompt_logits(runner(model_dir, "none"), ids)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (b - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.slow
def test_tp2_keeps_blocks_and_matches_hf(tmp_path):
    """Qwen2-MoE (routed and shared experts split over the ranks, in whole blocks)."""
    model_dir, reference = _files("qwen2_moe", tmp_path)
    prompts = ["def add(a, b):", "The quick brown", "print('hello"]
    with LLM(model_dir, tensor_parallel_size=2, max_model_len=256, block_size=8,
             max_num_batched_tokens=16, num_gpu_blocks_override=40) as llm:
        assert llm.inputs.ready.quantization.startswith("gguf")
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True), use_tqdm=False)
    refs = hf_greedy(reference, [o.prompt_token_ids for o in outs], 12)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], refs)
