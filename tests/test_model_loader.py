"""Checkpoint loading: sharded files, dtypes, TP sharding, and clear errors for bad inputs."""
from __future__ import annotations

import os

import pytest
import torch
from model_utils import assert_greedy_matches, edit_config, hf_greedy, make_tiny_model
from test_model_runner import PROMPTS, generate

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.vocab_embedding import ParallelLMHead
from worker.models.config import UnsupportedModelError
from worker.models.registry import load_model_config


def test_sharded_checkpoint_with_index(tmp_path):
    path = str(tmp_path / "m")
    from transformers import AutoModelForCausalLM
    make_tiny_model(path, "qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    ours, _ = generate(sharded, PROMPTS["mixed"][:3])
    assert_greedy_matches(ours, hf_greedy(path, PROMPTS["mixed"][:3], 10))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_checkpoints(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("DELTASERVE_CPU_BF16", "1")  # as on a CPU with native half support
    path = make_tiny_model(str(tmp_path / "m"), "llama", dtype=dtype)
    assert load_model_config(path).dtype == dtype
    ours, _ = generate(path, PROMPTS["mixed"][:3])  # float32 compute, like the reference
    assert_greedy_matches(ours, hf_greedy(path, PROMPTS["mixed"][:3], 10))
    from protocol import EngineConfig
    from worker.model_runner import ModelRunner
    runner = ModelRunner(EngineConfig(model=path, dtype="auto", num_gpu_blocks_override=8))
    assert runner.dtype == dtype and runner.kv_caches[0][0].dtype == dtype


def _write_config(tmp_path, **changes) -> str:
    return edit_config(make_tiny_model(str(tmp_path / "m"), "llama"), **changes)


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture.*GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64},
     "sliding_window=64"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_configs_are_named(tmp_path, changes, message):
    path = _write_config(tmp_path, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model_config(path)


def test_missing_and_unknown_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    from protocol import EngineConfig
    from worker.model_runner import ModelRunner
    path = make_tiny_model(str(tmp_path / "m"), "llama")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    del weights["model.norm.weight"]
    save_file(weights, file)
    with pytest.raises(ValueError, match="missing weights.*model.norm.weight"):
        ModelRunner(EngineConfig(model=path, num_gpu_blocks_override=4))
    weights["model.norm.weight"] = torch.ones(64)
    weights["model.extra.weight"] = torch.ones(3)
    save_file(weights, file)
    with pytest.raises(ValueError, match="model.extra.weight"):
        ModelRunner(EngineConfig(model=path, num_gpu_blocks_override=4))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(str(tmp_path))


def test_max_model_len_beyond_the_model_is_refused(tmp_path):
    from protocol import EngineConfig
    from worker.model_runner import ModelRunner
    path = make_tiny_model(str(tmp_path / "m"), "llama")
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        ModelRunner(EngineConfig(model=path, max_model_len=1024, num_gpu_blocks_override=4))


def _shards(make, load, world: int) -> list[torch.Tensor]:
    out = []
    for rank in range(world):
        layer = make(TensorParallel(rank, world))
        load(layer)
        out.append(layer.weight.data.clone())
    return out


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_qkv_shards_follow_heads(num_kv_heads):
    d, heads, world = 8, 4, 2
    q, k, v = (torch.randn(n * d, 16) for n in (heads, num_kv_heads, num_kv_heads))

    def load(layer):
        for part, w in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, w, part)
    shards = _shards(lambda tp: QKVParallelLinear(16, d, heads, num_kv_heads, tp), load, world)
    kv_per_rank = max(1, num_kv_heads // world)
    for rank, w in enumerate(shards):
        q_part, k_part, _ = w.split([heads // world * d, kv_per_rank * d, kv_per_rank * d])
        torch.testing.assert_close(q_part, q.view(heads, d, 16)[rank * 2:rank * 2 + 2].flatten(0, 1))
        kv_head = rank * num_kv_heads // world if num_kv_heads < world else rank * kv_per_rank
        torch.testing.assert_close(
            k_part, k.view(num_kv_heads, d, 16)[kv_head:kv_head + kv_per_rank].flatten(0, 1))


def test_column_row_and_vocab_shards_reassemble():
    gate, up, down = torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)
    merged = _shards(lambda tp: MergedColumnParallelLinear(8, [12, 12], tp),
                     lambda layer: (layer.weight_loader(layer.weight, gate, 0),
                                    layer.weight_loader(layer.weight, up, 1)), 2)
    torch.testing.assert_close(torch.cat([m[:6] for m in merged]), gate)
    torch.testing.assert_close(torch.cat([m[6:] for m in merged]), up)
    rows = _shards(lambda tp: RowParallelLinear(12, 8, tp),
                   lambda layer: layer.weight_loader(layer.weight, down), 2)
    torch.testing.assert_close(torch.cat(rows, dim=1), down)
    vocab = torch.randn(11, 4)  # not divisible by 2: the last rank is zero-padded
    heads = _shards(lambda tp: ParallelLMHead(11, 4, tp),
                    lambda layer: layer.weight_loader(layer.weight, vocab), 2)
    torch.testing.assert_close(torch.cat(heads)[:11], vocab)
    assert heads[1][-1].abs().sum() == 0
