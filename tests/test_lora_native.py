"""LoRA deltas inside the native layer loop (worker/lora/native.py) against the Python layer
loop applying the same adapters: hidden rows and written K/V equal up to float32 rounding, for
one adapter, adapters interleaved with base rows, and a step mixing decodes with a prefill
chunk; GGUF weights (three types merged into q/k/v, K-quants)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_utils import make_adapter
from test_native_layer_loop import TYPES, _metadata

from launch.model_cache.gguf_model import materialize_gguf
from protocol import EngineConfig
from protocol.lora import LoRARequest
from worker.lora.mapping import LoRAMapping
from worker.model_runner import ModelRunner
from worker.models.native_layer_loop import NativeLayerLoop
from worker.native import cpu_decoder

pytestmark = pytest.mark.skipif(
    cpu_decoder.load() is None,
    reason="the native kernels are unavailable here (no C++ compiler, or DELTASERVE_CPU_OPS=0)")


@pytest.fixture(scope="module")
def runner_with_adapters(tmp_path_factory):
    from gguf_utils import write_gguf
    from model_utils import make_tiny_model
    root = tmp_path_factory.mktemp("lora-native")
    hf = make_tiny_model(str(root / "hf"), tokenizer=True, hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3)
    write_gguf(hf, str(root / "tiny.gguf"), lambda name: TYPES.get(name.rsplit(".", 2)[-2]))
    model = materialize_gguf(str(root / "tiny.gguf"), str(root / "dir"))
    adapters = [make_adapter(hf, str(root / "a1"), 1, std=0.05),
                make_adapter(hf, str(root / "a2"), 2, ["q_proj", "down_proj"], r=4, std=0.05)]
    r = ModelRunner(EngineConfig(model=model, quantization="gguf", max_model_len=256,
                                 max_num_seqs=4, num_gpu_blocks_override=40, enable_lora=True,
                                 max_loras=2, max_lora_rank=8))
    for i, path in enumerate(adapters):
        r.lora.preload(LoRARequest(f"a{i + 1}", i + 1, path))
    return r, {i: r.lora._get(i) for i in (1, 2)}


@torch.inference_mode()
@pytest.mark.parametrize("adapters, query_lens", [
    ([1], [5]), ([2, 0, 1, 2], [1, 1, 1, 1]), ([0, 1, 1], [1, 1, 9]), ([1, 2], [1, 30])])
def test_native_deltas_equal_the_python_loop(runner_with_adapters, adapters, query_lens):
    r, models = runner_with_adapters
    model = r.model.model
    model.native_loop = NativeLayerLoop.build(model)
    tables = [[1 + 8 * i + j for j in range(8)] for i in range(len(adapters))]
    contexts = [3 if q == 1 else 0 for q in query_lens]
    metadata, positions = _metadata(query_lens, contexts, tables)
    ids = torch.randint(0, 200, (sum(query_lens),), generator=torch.Generator().manual_seed(1))
    r.lora.context.mapping = LoRAMapping.build(np.array(adapters), np.array(query_lens),
                                               models, torch.device("cpu"))
    native = model.native_loop
    assert native.takes(sum(query_lens), r.kv_caches)
    outs = []
    for loop in (native, False):
        model.native_loop = loop
        metadata.plan = None
        r.attention.plan(metadata)
        outs.append(r.model(ids, positions, r.kv_caches, metadata).clone())
    model.native_loop = native
    base = torch.zeros_like(outs[0])
    r.lora.context.mapping = None
    metadata.plan = None
    r.attention.plan(metadata)
    base = r.model(ids, positions, r.kv_caches, metadata)
    assert (outs[0] - base).abs().max() > 1e-3  # the adapters change the rows
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
