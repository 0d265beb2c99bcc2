"""LoRA without an engine: PEFT configs and adapter directories checked against a base model
(each refusal names its reason), the batched delta against a row-by-row reference in both
layouts, the scheduler's --max-loras gate, block hashes and KV events per adapter, and the
data-parallel choice."""
from __future__ import annotations

import json
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch
from lora_utils import make_adapter, write_gguf_adapter
from model_utils import make_tiny_model

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.kv_cache.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from launch.client.dp_client import ADAPTER_AFFINITY, DPEngineClient
from protocol import AddRequest, EngineConfig, SamplingParams, SchedulerStats
from protocol.kv_events import BlockStored
from protocol.lora import LoRARequest
from worker.lora.adapter_files import inspect_adapter
from worker.lora.lora_model import LoRAModel, load_lora_model
from worker.lora.mapping import LoRAMapping
from worker.lora.peft_config import LoRAAdapterError, LoRAAdapterNotFoundError, PeftConfig
from worker.model_runner import ModelRunner
from worker.models.registry import load_model_config


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("lora-units") / "model"), "llama")


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> str:
    return make_adapter(base, str(tmp_path_factory.mktemp("adapter") / "a"), 1)


def test_scaling_follows_peft():
    config = PeftConfig.parse({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4},
                               "alpha_pattern": {"layers.1.self_attn.v_proj": 2}}, "a")
    assert config.rank_and_scale("model.layers.0.self_attn.k_proj") == (8, 2.0)
    assert config.rank_and_scale("model.layers.0.self_attn.q_proj") == (4, 4.0)
    assert config.rank_and_scale("model.layers.1.self_attn.v_proj") == (8, 0.25)
    assert config.max_rank == 8
    rs = PeftConfig.parse({"r": 16, "lora_alpha": 8, "use_rslora": True}, "a")
    assert rs.rank_and_scale("x.q_proj") == (16, 8 / math.sqrt(16))


@pytest.mark.parametrize("field, value, reason", [
    ("use_dora", True, "DoRA"), ("bias", "all", "biases"),
    ("modules_to_save", ["lm_head"], "modules_to_save"), ("r", 0, "r must be"),
    ("init_lora_weights", "pissa", "base weights"), ("peft_type", "IA3", "not LoRA"),
    ("rank_pattern", {"(.*a)+$": 4}, "quantified groups"), ("rank_pattern", {"(": 4}, "pattern")])
def test_unsupported_features_are_named(field, value, reason):
    with pytest.raises(LoRAAdapterError, match=reason):
        PeftConfig.parse({"r": 8, "lora_alpha": 8, field: value}, "a")


def test_an_adapter_checks_against_its_base(base, adapter):
    spec = inspect_adapter("a", adapter, load_model_config(base), 16)
    assert spec.rank == 8 and len(spec.modules) == 2 * 7
    assert spec.digest == inspect_adapter("a", adapter, load_model_config(base), 8).digest
    with pytest.raises(LoRAAdapterError, match="rank 8, more than --max-lora-rank 4"):
        inspect_adapter("a", adapter, load_model_config(base), 4)


def test_an_adapter_of_another_base_is_refused(base, tmp_path):
    other = make_tiny_model(str(tmp_path / "other"), "llama", hidden_size=32,
                            intermediate_size=64)
    wrong = make_adapter(other, str(tmp_path / "wrong"), 2, targets=["q_proj"])
    with pytest.raises(LoRAAdapterError, match="another base model: .*q_proj.* 32 -> 32"):
        inspect_adapter("wrong", wrong, load_model_config(base), 16)
    deeper = make_tiny_model(str(tmp_path / "deeper"), "llama", num_hidden_layers=3)
    extra = make_adapter(deeper, str(tmp_path / "extra"), 3, targets=["o_proj"])
    with pytest.raises(LoRAAdapterError, match="in layer 2, the base has 2 layers"):
        inspect_adapter("extra", extra, load_model_config(base), 16)


def test_targets_we_cannot_apply_are_refused(base, tmp_path):
    head = make_adapter(base, str(tmp_path / "head"), 4, targets=["q_proj", "lm_head"])
    with pytest.raises(LoRAAdapterError, match="cannot apply tensor .*lm_head"):
        inspect_adapter("head", head, load_model_config(base), 16)


def test_missing_and_malformed_adapters(base, adapter, tmp_path):
    model = load_model_config(base)
    with pytest.raises(LoRAAdapterNotFoundError, match="neither a directory"):
        inspect_adapter("gone", str(tmp_path / "gone"), model, 16)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
    (broken / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(LoRAAdapterError, match="adapter_model.bin, a pickle, is not read"):
        inspect_adapter("broken", str(broken), model, 16)
    (broken / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(LoRAAdapterError, match="malformed header"):
        inspect_adapter("broken", str(broken), model, 16)
    with open(os.path.join(adapter, "adapter_model.safetensors"), "rb") as f:
        data = f.read()
    (broken / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])  # cut short
    with pytest.raises(LoRAAdapterError, match="malformed"):
        inspect_adapter("broken", str(broken), model, 16)


def _model(lora_id: int, a: torch.Tensor, b: torch.Tensor) -> LoRAModel:
    return LoRAModel(LoRARequest(f"a{lora_id}", lora_id, "/x"), [(a, b), None], 0, 0.0)


@pytest.mark.parametrize("request_ids", [[0, 1, 1, 2, 0], [1, 2, 1, 0, 2], [3, 3, 3]])
def test_the_batched_delta_equals_row_by_row(request_ids):
    torch.manual_seed(0)
    counts = np.array([2, 1, 3, 1, 2][:len(request_ids)])
    models = {i: _model(i, torch.randn(16, 4 + i), torch.randn(4 + i, 8)) for i in (1, 2, 3)}
    x, y = torch.randn(int(counts.sum()), 16), torch.randn(int(counts.sum()), 8)
    ids = np.array(request_ids)
    mapping = LoRAMapping.build(ids, counts, models, torch.device("cpu"))
    assert (mapping.index is None) == (request_ids != [1, 2, 1, 0, 2])
    expected = y.clone()
    for row, lora_id in enumerate(np.repeat(ids, counts)):
        if lora_id:
            a, b = models[lora_id].layers[0]
            expected[row] += x[row] @ a @ b
    untouched = y.clone()
    mapping.add_delta(y, x, 0)
    torch.testing.assert_close(y, expected)
    mapping.add_delta(untouched, x, 1)  # a layer no adapter targets
    assert LoRAMapping.build(np.zeros(3, np.int64), np.ones(3, np.int64), {},
                             torch.device("cpu")) is None


def _request(i: int, lora: LoRARequest | None, tokens: list[int] | None = None) -> Request:
    return Request(f"r{i}", tokens or list(range(10 + i, 30 + i)),
                   SamplingParams(max_tokens=4), 0.0, lora_request=lora)


def test_a_step_holds_at_most_max_loras_adapters():
    scheduler = Scheduler(SchedulerConfig(max_loras=2), CacheConfig(16, 200, True))
    loras = [LoRARequest(f"a{i}", i, f"/a{i}") for i in (1, 2, 3)]
    for i, lora in enumerate([loras[0], loras[1], loras[2], None, loras[0]]):
        scheduler.add_request(_request(i, lora))
    first = scheduler.schedule()
    admitted = [new.request_id for new in first.scheduled_new_reqs]
    assert admitted == ["r0", "r1", "r3", "r4"]  # a3 waits in its place, the others go on
    assert {n.lora_request.lora_int_id for n in first.scheduled_new_reqs if n.lora_request} \
        == {1, 2}
    scheduler.finish_requests(["r1"])
    assert [n.request_id for n in scheduler.schedule().scheduled_new_reqs] == ["r2"]


def test_blocks_of_different_adapters_never_match():
    kv = KVCacheManager(64, 4, True)
    kv.block_pool.record_kv_events(4)
    tokens = list(range(1, 14))
    a1, a2 = LoRARequest("a1", 1, "/a1", digest="d1"), LoRARequest("a1", 1, "/a1", digest="d2")
    first = _request(0, a1, tokens)
    kv.allocate_slots(first, len(tokens))
    assert kv.get_computed_blocks(_request(1, a1, tokens))[1] == 12  # its own adapter's
    for other in (None, a2, LoRARequest("a3", 3, "/a1", digest="d1")):
        assert kv.get_computed_blocks(_request(2, other, tokens))[1] == 0
    stored = [e for e in kv.block_pool.take_kv_events() if isinstance(e, BlockStored)]
    assert stored and all(e.lora_id == 1 and e.lora_name == "a1" for e in stored)
    assert stored[0].extra_keys == [("a1",)] * 3


class _Replica:
    def __init__(self, rank: int, running: int) -> None:
        self.rank, self.stats = rank, SchedulerStats(num_running=running)
        self.sent: list[AddRequest] = []

    def add_requests(self, batch: list[AddRequest]) -> None:
        self.sent += batch


def test_replicas_prefer_one_already_holding_the_adapter():
    client = DPEngineClient.__new__(DPEngineClient)
    client.replicas = [_Replica(0, 2), _Replica(1, 3)]
    client.live, client.sent, client.owner, client.deaths = [0, 1], [0, 0], {}, []
    client.adapter_of, client.adapters, client.dead = {}, [Counter(), Counter()], None
    lora = LoRARequest("a", 7, "/a")

    def add(rid: str, lora_request: LoRARequest | None) -> int:
        client.add_requests([AddRequest(rid, [1], SamplingParams(), 0.0,
                                        lora_request=lora_request)])
        return client.owner[rid]
    client.adapters[1][7] = 1  # replica 1 already runs adapter 7
    assert add("x", lora) == 1  # one running more, but it holds the adapter
    assert add("y", None) == 0
    client.replicas[1].stats = SchedulerStats(num_running=3 + ADAPTER_AFFINITY + 1)
    client.sent = [0, 0]
    assert add("z", lora) == 0  # far busier: load wins
    client._forget("x")
    assert client.adapters[1][7] == 1 and "x" not in client.owner


@pytest.mark.parametrize("f16", [False, True])
def test_llama_cpp_gguf_adapters_read_as_their_peft_twins(base, adapter, tmp_path, f16):
    with open(os.path.join(base, "config.json")) as f:
        hf = json.load(f)
    twin = write_gguf_adapter(adapter, str(tmp_path / "a.gguf"), hf, f16=f16)
    model = load_model_config(base)
    peft, gguf = inspect_adapter("a", adapter, model, 16), inspect_adapter("g", twin, model, 16)
    assert [(m.module, m.rank, m.scale) for m in peft.modules] == \
        [(m.module, m.rank, m.scale) for m in gguf.modules]
    targets = ModelRunner(EngineConfig(model=base, enable_lora=True, max_model_len=64,
                                       num_gpu_blocks_override=8)).lora.targets
    a = load_lora_model(LoRARequest("a", 1, adapter), peft, targets)
    g = load_lora_model(LoRARequest("g", 2, twin), gguf, targets)
    for x, y in zip(a.layers, g.layers):
        for p, q in zip(x, y):
            torch.testing.assert_close(p, q, rtol=1e-3 if f16 else 0, atol=1e-3 if f16 else 0)


def test_malformed_gguf_adapters_are_refused(base, adapter, tmp_path):
    with open(os.path.join(base, "config.json")) as f:
        hf = json.load(f)
    model = load_model_config(base)
    whole = open(write_gguf_adapter(adapter, str(tmp_path / "a.gguf"), hf), "rb").read()
    (tmp_path / "zeros.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "head.gguf").write_bytes(whole[:40])
    (tmp_path / "padded.gguf").write_bytes(whole + b"\0" * (2 << 20))
    for file, reason in [("zeros", "not a GGUF file|not a llama.cpp LoRA"),
                         ("cut", "truncated"), ("head", "truncated"),
                         ("padded", "bytes past its tensors")]:
        with pytest.raises(LoRAAdapterError, match=reason):
            inspect_adapter("x", str(tmp_path / f"{file}.gguf"), model, 16)
    with pytest.raises(LoRAAdapterError, match="rank 8, more than --max-lora-rank 4"):
        inspect_adapter("x", str(tmp_path / "a.gguf"), model, 4)
    qwen = load_model_config(make_tiny_model(str(tmp_path / "qwen"), "qwen2"))
    with pytest.raises(LoRAAdapterError, match="another base model: a llama GGUF adapter"):
        inspect_adapter("x", str(tmp_path / "a.gguf"), qwen, 16)


def test_background_reads_leave_no_thread_behind():
    """A read runs on a thread of its own that ends with it (a kept thread that ran torch ops
    keeps an OpenMP team, which throttles every team's waits); its result or error reaches
    the future."""
    import threading
    from types import SimpleNamespace

    from worker.lora.manager import LoRAManager

    def load(lora_request):
        if lora_request == "bad":
            raise RuntimeError("unreadable")
        return torch.ones(1 << 20).mul(2).sum().item()  # a parallel torch op on the reader

    manager = SimpleNamespace(reading=threading.Lock(), _load=load)
    good = LoRAManager._read_in_background(manager, "good")
    bad = LoRAManager._read_in_background(manager, "bad")
    assert good.result(timeout=30) == 2 * (1 << 20)
    with pytest.raises(RuntimeError, match="unreadable"):
        bad.result(timeout=30)
    for thread in threading.enumerate():
        if thread.name == "deltaserve-lora":
            thread.join(timeout=30)
    assert not any(t.name == "deltaserve-lora" for t in threading.enumerate())
