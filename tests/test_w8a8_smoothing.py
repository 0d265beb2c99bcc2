"""w8a8's load-time smoothing (worker/layers/quantization/smoothing.py): folding the factors
into norms, v rows and up rows leaves the float model's function unchanged (GQA groups
included), flattens the activations' channel maxima, and can be turned off."""
from __future__ import annotations

import pytest
import torch
from model_utils import make_tiny_model

from protocol import EngineConfig
from worker.layers.quantization import smoothing
from worker.layers.quantization.calibration_text import CALIBRATION_TEXT
from worker.layers.quantization.w8a8 import W8A8Config
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    # GQA 4:2, K multiples of 32 (the kernels' path), a tokenizer for the calibration text
    return make_tiny_model(str(tmp_path_factory.mktemp("smooth") / "m"), tokenizer=True,
                           hidden_size=128, intermediate_size=256, num_hidden_layers=3)


def _runner(model: str, smoothing_on: bool = True) -> ModelRunner:
    return ModelRunner(EngineConfig(model=model, quantization="w8a8", max_model_len=128,
                                    max_num_seqs=1, num_gpu_blocks_override=10,
                                    w8a8_smoothing=smoothing_on))


def _spread(m: torch.Tensor) -> float:
    """How far the largest channel maximum stands above the median one."""
    return (m.max() / m.median()).item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: qkv bias; qwen3: q/k norms
def test_smoothing_is_exact_in_float_and_flattens_an_outlier_channel(arch, tiny, tmp_path,
                                                                     monkeypatch):
    if arch != "llama":
        tiny = make_tiny_model(str(tmp_path / arch), arch, tokenizer=True, hidden_size=128,
                               intermediate_size=256, num_hidden_layers=3)
    seen = {}

    def around(self, model, tp, model_dir):
        layer = model.model.layers[0]  # an outlier channel into both norms' outputs
        layer.input_layernorm.weight.data[5] *= 30
        layer.post_attention_layernorm.weight.data[7] *= 30
        ids = smoothing.calibration_ids(model_dir)[:100]
        seen["before"] = smoothing.calibrate(model, tp, ids)
        seen["products"] = smoothing.smooth_model(model, tp, model_dir)
        seen["after"] = smoothing.calibrate(model, tp, ids)

    monkeypatch.setattr(W8A8Config, "process_model_after_loading", around)
    r = _runner(tiny)
    assert r.quantization == "w8a8" and seen["products"] == 4 * 3
    (before, h0), (after, h1) = seen["before"], seen["after"]
    torch.testing.assert_close(h1, h0, rtol=1e-4, atol=1e-4)
    for name in ("qkv", "gate_up"):
        assert _spread(after[0][name]) < 0.5 * _spread(before[0][name]), name
    for b, a in zip(before, after):
        for name in ("qkv", "o", "gate_up", "down"):
            assert not torch.allclose(a[name], b[name]), name


def test_calibration_text_is_not_the_evaluation_text():
    from test_gguf_a8_model import ENGLISH, PYTHON
    for held_out in (ENGLISH, PYTHON):
        assert held_out.strip()[:60] not in CALIBRATION_TEXT


@pytest.mark.timeout(120)
def test_smoothing_changes_the_products_and_can_be_turned_off(tiny):
    smoothed, plain = _runner(tiny), _runner(tiny, smoothing_on=False)
    a, b = (dict(r.model.named_parameters()) for r in (smoothed, plain))
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(a[norm], b[norm])
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert a[qkv].dtype == torch.int8 and not torch.equal(a[qkv], b[qkv])


def _record_smoothed(store: dict):
    """A process_model_after_loading that smooths as W8A8Config does, then keeps copies of
    layer 0's smoothed float weights and the layer objects' shards (for slicing)."""
    def hook(self, model, tp, model_dir):
        smoothing.smooth_model(model, tp, model_dir)
        layer = model.model.layers[0]
        store.update({name: p.detach().float().clone()
                      for name, p in layer.named_parameters()})
        attn, mlp = layer.self_attn, layer.mlp
        store["shards"] = {part: attn.qkv_proj.output_shard(part) for part in "qkv"}
        store["gate_up_shards"] = [mlp.gate_up_proj.output_shard(p) for p in (0, 1)]
        store["o_cols"] = (attn.o_proj.in_start, attn.o_proj.in_per_rank)
        store["down_cols"] = (mlp.down_proj.in_start, mlp.down_proj.in_per_rank)
    return hook


def _tp_rank(rank: int, init_method: str, model_dir: str, out: str) -> None:
    """One rank of a w8a8 TP=2 group: its smoothed float weights (layer 0), and its native
    layer loop against its Python loop (smoothed w8a8 layers)."""
    import os

    from test_native_layer_loop import _check_equal_to_loop

    from worker.distributed.tensor_parallel import TensorParallel
    torch.set_num_threads(1)
    store: dict = {}
    W8A8Config.process_model_after_loading = _record_smoothed(store)
    tp = TensorParallel.initialize(rank, 2, init_method, torch.device("cpu"), timeout_s=30.0)
    r = ModelRunner(EngineConfig(model=model_dir, quantization="w8a8", max_model_len=512,
                                 max_num_seqs=1, num_gpu_blocks_override=34,
                                 tensor_parallel_size=2), tp)
    store["rows"] = _check_equal_to_loop(r)
    torch.save(store, os.path.join(out, f"rank{rank}.pt"))
    tp.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_smooth_their_shards_of_the_one_rank_weights(tmp_path,
                                                                           monkeypatch):
    """3 KV heads over 2 ranks (2 + 1, GQA groups of 2): each rank's smoothed weights are its
    shards of the smoothed TP=1 weights (the norms' factors agree across ranks: the same
    activations, the weight maxima gathered), and each rank's native loop equals its Python
    loop with smoothed w8a8 layers."""
    import multiprocessing
    model = make_tiny_model(str(tmp_path / "m"), tokenizer=True, hidden_size=192,
                            intermediate_size=384, num_attention_heads=6,
                            num_key_value_heads=3, num_hidden_layers=2)
    one: dict = {}
    monkeypatch.setattr(W8A8Config, "process_model_after_loading", _record_smoothed(one))
    ModelRunner(EngineConfig(model=model, quantization="w8a8", max_model_len=512,
                             max_num_seqs=1, num_gpu_blocks_override=34))
    context = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path}/rendezvous"
    procs = [context.Process(target=_tp_rank, args=(r, init, model, str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    close = dict(rtol=2e-5, atol=1e-6)
    d, heads, kv = 32, 6, 3
    qkv_starts = {"q": 0, "k": heads * d, "v": (heads + kv) * d}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["rows"] > 6
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            torch.testing.assert_close(got[norm], one[norm], **close)
        qkv = got["self_attn.qkv_proj.weight"]
        for part, (offset, rows, start) in got["shards"].items():
            start += qkv_starts[part]
            torch.testing.assert_close(qkv[offset:offset + rows],
                                       one["self_attn.qkv_proj.weight"][start:start + rows],
                                       **close)
        gate_up, inter = got["mlp.gate_up_proj.weight"], 384
        for p, (offset, rows, start) in enumerate(got["gate_up_shards"]):
            start += p * inter
            torch.testing.assert_close(gate_up[offset:offset + rows],
                                       one["mlp.gate_up_proj.weight"][start:start + rows],
                                       **close)
        for name, (start, size) in (("self_attn.o_proj.weight", got["o_cols"]),
                                    ("mlp.down_proj.weight", got["down_cols"])):
            torch.testing.assert_close(got[name], one[name][:, start:start + size], **close)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_models_of_another_shape_load_unsmoothed(arch, tmp_path, monkeypatch):
    seen = []
    original = smoothing.smooth_model

    def counted(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr("worker.layers.quantization.w8a8.smooth_model", counted)
    model = make_tiny_model(str(tmp_path / arch), arch, tokenizer=True, hidden_size=128,
                            intermediate_size=256)
    assert _runner(model).quantization == "w8a8" and seen == [0]
