"""Qwen3-MoE, Mixtral and Qwen2-MoE from Hugging Face directories (tiny random checkpoints made
with transformers: 8 experts, 3 per token, uneven routing; Qwen3-MoE with a dense layer,
Qwen2-MoE with a shared expert and a decoder_sparse_step of 2): the logits equal Hugging
Face's in float32, the engine's greedy tokens equal HF's at TP 1 and 2 with chunked prefill,
preemption and prefix caching on; int8 and bfloat16 stay close; what is not implemented is
refused by name."""
from __future__ import annotations

import pytest
import torch
from model_utils import (
    CORPUS,
    MOE_ARCHS,
    assert_greedy_matches,
    edit_config,
    hf_greedy,
    make_tiny_model,
)
from quant_utils import prompt_logits, runner

from launch import LLM, SamplingParams
from launch.processing.tokenizer import load_tokenizer
from worker.layers.fused_moe.layer import FusedMoE
from worker.models.config import UnsupportedModelError
from worker.models.registry import load_model_config

OVERRIDES = {"qwen2_moe": {"num_hidden_layers": 4, "decoder_sparse_step": 2}}
SHARED = "Pack my box with five dozen liquor jugs! The quick brown fox jumps. "
TEXTS = [SHARED + "def add(a, b):", "print('hello", SHARED + "return a + b", "The lazy dog",
         SHARED * 2]
NEW = 12


@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny(request, tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param) / "m"), request.param,
                           tokenizer=True, **OVERRIDES.get(request.param, {}))


def _hf_logits(model_dir: str, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_logits_equal_hugging_face(tiny):
    r = runner(tiny, "none")
    layers = r.model.model.layers
    sparse = [hasattr(layer.mlp, "experts") for layer in layers]
    expected = {"Qwen3MoeForCausalLM": [True, False], "MixtralForCausalLM": [True, True],
                "Qwen2MoeForCausalLM": [False, True, False, True]}
    assert sparse == expected[load_model_config(tiny).architecture]
    assert all(layer.mlp.experts.fused_experts.is_native for layer in layers
               if hasattr(layer.mlp, "experts"))
    ids = load_tokenizer(tiny).encode(CORPUS[:300])
    ours, ref = prompt_logits(r, ids), _hf_logits(tiny, ids)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_routing_is_uneven_and_uses_several_experts(tiny):
    """On a real prompt each token takes 3 experts, most experts get some, and the busiest
    get far more than the quietest."""
    r = runner(tiny, "none")
    routers = [layer.mlp.gate for layer in r.model.model.layers if hasattr(layer.mlp, "gate")]
    picks = []
    hooks = [m.register_forward_hook(lambda m, i, out: picks.append(out.topk(3).indices))
             for m in routers]
    prompt_logits(r, load_tokenizer(tiny).encode(CORPUS[:300]))
    for hook in hooks:
        hook.remove()
    for ids in picks:
        counts = torch.bincount(ids.flatten(), minlength=8)
        assert (counts > 0).sum() >= 4 and counts.max() >= 1.5 * counts.min(), counts


def test_int8_and_bfloat16_stay_close(tiny):
    ids = load_tokenizer(tiny).encode(CORPUS[:200])
    ref = prompt_logits(runner(tiny, "none"), ids)
    int8 = runner(tiny, "int8")
    experts = [layer.mlp.experts for layer in int8.model.model.layers
               if hasattr(layer.mlp, "experts")]
    assert experts and all(isinstance(e, FusedMoE) for e in experts)
    assert all(e.w13_weight.dtype == torch.int8 for e in experts)
    assert "int8 x" in int8.weights_summary
    # (a tiny random model amplifies quantization: a router's top 3 of 8 flips easily)
    for logits in (prompt_logits(int8, ids), prompt_logits(_runner_with_dtype(tiny, "bfloat16"),
                                                           ids)):
        assert (logits - ref).abs().mean() < 0.1 * ref.abs().mean()
        assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def _runner_with_dtype(model_dir: str, dtype: str):
    from protocol import EngineConfig
    from worker.model_runner import ModelRunner
    return ModelRunner(EngineConfig(model=model_dir, dtype=dtype, max_model_len=256,
                                    max_num_seqs=1, num_gpu_blocks_override=20))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_hf_with_chunks_preemption_and_prefix_caching(tiny, tp):
    # A small token budget chunks the prefills; 20 blocks of 8 tokens force preemption.
    with LLM(tiny, tensor_parallel_size=tp, dtype="float32", block_size=8,
             max_num_batched_tokens=16, num_gpu_blocks_override=20, max_model_len=256,
             enable_prefix_caching=True) as llm:
        outs = llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                  ignore_eos=True), use_tqdm=False)
        stats = llm.engine.stats
    refs = hf_greedy(tiny, [o.prompt_token_ids for o in outs], NEW)
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], refs)
    assert stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    assert max(o.num_cached_tokens for o in outs) >= 32, "shared prefixes should hit"


def _config(tmp_path, **changes) -> str:
    return edit_config(make_tiny_model(str(tmp_path / "m"), "mixtral"), **changes)


def test_unimplemented_configs_are_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="sliding_window=64"):
        load_model_config(_config(tmp_path, sliding_window=64))
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 with 8 experts"):
        load_model_config(_config(tmp_path, num_experts_per_tok=9))
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        load_model_config(_config(tmp_path, hidden_act="gelu"))
