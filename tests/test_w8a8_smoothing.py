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
def test_smoothing_is_exact_in_float_and_flattens_an_outlier_channel(tiny, monkeypatch):
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
