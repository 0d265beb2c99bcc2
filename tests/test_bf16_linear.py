"""bf16 linears multiplied in float32 where this CPU's FMAs outrun its bf16 products
(worker/layers/bf16_linear.py): the route's switch, the products against a float64
reference, and a bf16 model on that route (float32 activations around its linears, bf16
weights and KV cache, greedy tokens that follow float32's up to bf16 near-ties)."""
from __future__ import annotations

import logging

import pytest
import torch
from model_utils import hf_greedy, model_dir_for
from test_compute_dtype import MAX_NEW, assert_follows_float32, check_bf16_greedy_follows_float32
from test_model_runner import PROMPTS

from protocol import EngineConfig
from protocol.speculative_config import SpeculativeConfig
from worker.device import ENV_OVERRIDE
from worker.host import memory
from worker.layers import bf16_linear, onednn_linear
from worker.model_runner import ModelRunner
from worker.models import footprint
from worker.models.registry import load_model_config

pytestmark = pytest.mark.skipif(not onednn_linear.enabled(torch.device("cpu")),
                                reason="no oneDNN packing (torch without it, or DELTASERVE_ONEDNN=0): "
                                "bf16 products only")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return model_dir_for(tmp_path_factory, "llama", dtype=torch.bfloat16)


def test_switch_forces_either_route(monkeypatch):
    for forced in (bf16_linear.FLOAT32, bf16_linear.BFLOAT16):
        monkeypatch.setenv(bf16_linear.ENV_SWITCH, forced)
        assert bf16_linear.route() == forced
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, "fp8")
    with pytest.raises(ValueError, match=bf16_linear.ENV_SWITCH):
        bf16_linear.route()
    monkeypatch.delenv(bf16_linear.ENV_SWITCH)
    assert bf16_linear.route() in (bf16_linear.FLOAT32, bf16_linear.BFLOAT16)


def test_float32_copy_only_for_bf16_on_the_float32_route(monkeypatch):
    w = torch.randn(64, 96).bfloat16()
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.BFLOAT16)
    assert bf16_linear.float32_copy(w) is None
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    assert bf16_linear.float32_copy(w.float()) is None
    copy = bf16_linear.float32_copy(w)
    assert copy is not None and copy.is_mkldnn and copy.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 7, bf16_linear.FLOAT32_ROWS - 1, bf16_linear.FLOAT32_ROWS,
                                  77, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_reference(monkeypatch, rows, bias):
    """From FLOAT32_ROWS rows: x · W.float()ᵀ to float32 rounding (a float32 x used as it is);
    below: bf16 products of x rounded to bf16 (bf16-level error). float32 out either way."""
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(160, 256, generator=gen).bfloat16()
    b = torch.randn(160, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 256, generator=gen)
    out = bf16_linear.linear(x, onednn_linear.pack(w), bf16_linear.float32_copy(w), b)
    assert out.dtype == torch.float32 and out.shape == (rows, 160)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    if rows >= bf16_linear.FLOAT32_ROWS:
        assert err < 1e-5
    else:
        assert err < 3e-2
        rounded = x.bfloat16().double() @ w.double().T + (0 if b is None else b.double())
        assert (out.double() - rounded).abs().max().item() / ref.abs().max().item() < 1e-2
    bf16_in = bf16_linear.linear(x.bfloat16(), onednn_linear.pack(w), bf16_linear.float32_copy(w), b)
    assert bf16_in.dtype == torch.float32


def _runner(model_dir: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model=model_dir, dtype="bfloat16", num_gpu_blocks_override=8))


def test_float32_route_layout(model_dir, monkeypatch):
    """Layers take float32 activations; weights, KV cache and the tied table stay bf16."""
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    runner = _runner(model_dir)
    assert runner.dtype == torch.bfloat16
    assert {t.dtype for kv in runner.kv_caches for t in kv} == {torch.bfloat16}
    for layer in runner.model.model.layers:
        assert layer.dtype == torch.float32
        qkv = layer.self_attn.qkv_proj
        assert qkv.cache_dtype == torch.bfloat16 and qkv.weight.dtype == torch.bfloat16
        assert qkv.weight_float32 is not None
    assert runner.model.lm_head.weight_float32 is not None
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.BFLOAT16)
    runner = _runner(model_dir)
    for layer in runner.model.model.layers:
        assert layer.dtype == torch.bfloat16 and layer.self_attn.qkv_proj.weight_float32 is None


SMALL_HOST = {memory.LIMIT_ENV: str(64 << 10)}  # 64 KiB: the tiny model does not fit


def _probed_float32() -> None:
    if not bf16_linear.products_slow(torch.bfloat16):
        pytest.skip("this CPU's bf16 products are not slower than its float32 FMAs: the "
                    "probe never takes the float32 route")


@pytest.mark.parametrize("env", [{bf16_linear.ENV_SWITCH: bf16_linear.FLOAT32},
                                 {bf16_linear.ENV_SWITCH: bf16_linear.BFLOAT16}, SMALL_HOST],
                         ids=["float32", "bfloat16", "small-host"])
def test_greedy_follows_float32(model_dir, monkeypatch, env):
    """Each route (forced, or bf16 on a host too small for the copies): every divergence from
    float32 greedy happens at a bf16-level near-tie of float32's logits; most requests never
    diverge (prefill rows take the float32 copies, one-request decode rows the bf16 weights)."""
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.delenv(bf16_linear.ENV_SWITCH, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_bf16_greedy_follows_float32(model_dir)


def test_estimate_counts_the_float32_copies(model_dir, monkeypatch):
    """What the memory check adds up is what the float32 route holds: one float32 weight per
    weight of every linear layer and of the (tied) LM head."""
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    runner = _runner(model_dir)
    copies = [m.weight_float32 for m in runner.model.modules()
              if getattr(m, "weight_float32", None) is not None]
    assert sum(c.numel() for c in copies) == footprint.linear_weights(runner.model_config)


def test_a_small_host_keeps_one_copy(model_dir, monkeypatch, caplog):
    """Where the copies do not fit beside the weights and KV cache in what the host can give,
    the probed float32 route gives way to bf16 (one line says why); forcing float32 still
    forces it, and with room the probe's answer stands."""
    _probed_float32()
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.delenv(bf16_linear.ENV_SWITCH, raising=False)
    monkeypatch.setenv(memory.LIMIT_ENV, SMALL_HOST[memory.LIMIT_ENV])
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        runner = _runner(model_dir)
    assert "do not fit beside" in caplog.text and memory.LIMIT_ENV in caplog.text
    assert bf16_linear.route() == bf16_linear.BFLOAT16
    for layer in runner.model.model.layers:
        assert layer.dtype == torch.bfloat16 and layer.self_attn.qkv_proj.weight_float32 is None
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    assert _runner(model_dir).model.model.layers[0].self_attn.qkv_proj.weight_float32 is not None
    monkeypatch.delenv(bf16_linear.ENV_SWITCH)
    monkeypatch.delenv(memory.LIMIT_ENV)
    assert _runner(model_dir).model.model.layers[0].dtype == torch.float32


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A one-layer bf16 draft with the target's vocabulary."""
    return model_dir_for(tmp_path_factory, "llama", dtype=torch.bfloat16, seed=7,
                         num_hidden_layers=1)


def _drafted_runner(model_dir: str, draft_dir: str | None) -> ModelRunner:
    spec = None if draft_dir is None else SpeculativeConfig(
        method="draft_model", num_speculative_tokens=2, model=draft_dir)
    return ModelRunner(EngineConfig(model=model_dir, dtype="bfloat16", num_gpu_blocks_override=8,
                                    speculative_config=spec))


def _copies(module: torch.nn.Module) -> int:
    return sum(m.weight_float32.numel() for m in module.modules()
               if getattr(m, "weight_float32", None) is not None)


def test_estimate_counts_the_draft_models_copies(model_dir, draft_dir, monkeypatch):
    """With a draft model the float32 route copies its linears too: the estimate counts the
    models a worker holds, the target's and the draft's (whose config is read once: the
    drafter's is the one the estimate counted)."""
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.setenv(bf16_linear.ENV_SWITCH, bf16_linear.FLOAT32)
    runner = _drafted_runner(model_dir, draft_dir)
    held = [runner.model_config, runner.draft_config]
    assert [m.num_hidden_layers for m in held] == [2, 1]
    assert runner.drafter.model_config is runner.draft_config
    assert _copies(runner.drafter.model) == footprint.linear_weights(held[1]) > 0
    assert _copies(runner.model) + _copies(runner.drafter.model) == \
        sum(map(footprint.linear_weights, held))


def test_a_host_with_room_for_the_target_alone_keeps_one_copy(model_dir, draft_dir,
                                                               monkeypatch, caplog):
    """A host that holds the target's copies, weights and KV cache but not the draft's too:
    with the draft configured the probed float32 route gives way to bf16; without, it stands."""
    _probed_float32()
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.delenv(bf16_linear.ENV_SWITCH, raising=False)
    target, draft = (load_model_config(d) for d in (model_dir, draft_dir))
    need = [2 * footprint.weights(m) + 4 * footprint.linear_weights(m)
            + 8 * footprint.kv_block_bytes(m, 16, 1, 2) for m in (target, draft)]
    monkeypatch.setenv(memory.LIMIT_ENV, str(need[0] + need[1] // 2))
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        runner = _drafted_runner(model_dir, draft_dir)
    assert "do not fit beside" in caplog.text
    assert runner.drafter.model.model.layers[0].self_attn.qkv_proj.weight_float32 is None
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight_float32 is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        runner = _drafted_runner(model_dir, None)
    assert "do not fit beside" not in caplog.text
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight_float32 is not None


def test_budget_fits_weights_copies_and_kv_cache():
    budget = bf16_linear.CopiesBudget(copies=4 << 30, weights=2 << 30, kv_cache=1 << 30,
                                      available=7 << 30, source="test")
    assert budget.fits()
    assert not bf16_linear.CopiesBudget(4 << 30, 2 << 30, 1 << 30, (7 << 30) - 1, "x").fits()
    assert "4.00 GiB" in budget.describe() and "1.00 GiB of KV" in budget.describe() and "(test)" in budget.describe()


def _route_rank(rank: int, init_method: str, out_dir: str) -> None:
    """Rank 0 forced to the float32 route, rank 1 to bf16 (as a rank on a loaded CPU could
    measure): after `agree` both take bf16, the route every rank can take."""
    import os

    from worker.distributed.tensor_parallel import TensorParallel
    os.environ[bf16_linear.ENV_SWITCH] = (bf16_linear.FLOAT32, bf16_linear.BFLOAT16)[rank]
    torch.set_num_threads(1)
    tp = TensorParallel.initialize(rank, 2, init_method, torch.device("cpu"))
    own = bf16_linear.route()
    bf16_linear.agree(tp)
    torch.save([own, bf16_linear.route()], os.path.join(out_dir, f"rank{rank}.pt"))
    tp.shutdown()


def test_tensor_parallel_ranks_agree_on_one_route(tmp_path):
    """A TP=2 group whose ranks measured differently once summed float32 activations with
    bf16 ones in gloo and aborted; `agree` gives every rank the same route."""
    from test_shm_all_reduce import _run_group
    per_rank = _run_group(tmp_path, _route_rank)
    assert [own for own, _ in per_rank] == [bf16_linear.FLOAT32, bf16_linear.BFLOAT16]
    assert [agreed for _, agreed in per_rank] == [bf16_linear.BFLOAT16] * 2


def _budget_rank(rank: int, init_method: str, out_dir: str) -> None:
    """Neither rank forced; rank 0's host cannot hold the float32 copies, rank 1's can: the
    group takes bf16 on both (where the probe says float32; else bf16 anyway)."""
    import os

    from worker.distributed.tensor_parallel import TensorParallel
    os.environ.pop(bf16_linear.ENV_SWITCH, None)
    torch.set_num_threads(1)
    tp = TensorParallel.initialize(rank, 2, init_method, torch.device("cpu"))
    budget = bf16_linear.CopiesBudget(copies=3 << 30, weights=1 << 30, kv_cache=1 << 30,
                                      available=(4 << 30, 64 << 30)[rank], source="test")
    agreed = bf16_linear.agree(tp, budget)
    torch.save([budget.fits(), agreed, bf16_linear.route()], os.path.join(out_dir, f"rank{rank}.pt"))
    tp.shutdown()


def test_tensor_parallel_ranks_agree_when_one_host_is_short(tmp_path):
    from test_shm_all_reduce import _run_group
    per_rank = _run_group(tmp_path, _budget_rank)
    assert [fits for fits, _, _ in per_rank] == [False, True]
    assert [agreed for _, agreed, _ in per_rank] == [bf16_linear.BFLOAT16] * 2
    assert [route for _, _, route in per_rank] == [bf16_linear.BFLOAT16] * 2


def test_tensor_parallel_engine_on_a_small_host(model_dir, monkeypatch, capfd):
    """TP=2 workers each size the float32 copies against a host too small for them (each
    says so), vote, and run the bf16 route: greedy tokens follow float32's as on one rank."""
    from launch import LLM
    from protocol import SamplingParams
    monkeypatch.setenv(ENV_OVERRIDE, "1")
    monkeypatch.delenv(bf16_linear.ENV_SWITCH, raising=False)
    monkeypatch.setenv(memory.LIMIT_ENV, SMALL_HOST[memory.LIMIT_ENV])
    prompts = PROMPTS["mixed"]
    # (a cache of its own size: the default one, a quarter of 64 KiB, would not hold 2 blocks)
    with LLM(model_dir, tensor_parallel_size=2, dtype="bfloat16", max_model_len=256,
             num_gpu_blocks_override=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
    assert_follows_float32([o.outputs[0].token_ids for o in outs],
                           hf_greedy(model_dir, prompts, MAX_NEW))
    assert capfd.readouterr().err.count("do not fit beside") == 2  # one line per rank


def test_a_float32_tensor_parallel_engine_probes_nothing(tmp_path, monkeypatch, capfd):
    """No rank computes in bf16: no vote, no probe, no bf16 line."""
    from launch import LLM
    from protocol import SamplingParams
    monkeypatch.delenv(bf16_linear.ENV_SWITCH, raising=False)
    model = _bf16_model(tmp_path)
    with LLM(model, tensor_parallel_size=2, dtype="float32", max_model_len=256,
             num_gpu_blocks_override=64) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert "bf16 linears" not in capfd.readouterr().err


def _bf16_model(tmp_path) -> str:
    from model_utils import make_tiny_model
    return make_tiny_model(str(tmp_path / "model"), "llama", dtype=torch.bfloat16)


def _mixed_rank(rank: int, init_method: str, out_dir: str) -> None:
    """Rank 0's CPU multiplies bf16 natively, rank 1's does not (it computes in float32):
    both still take part in the route's vote (a rank skipping it left the other waiting)."""
    import os

    from worker.distributed.tensor_parallel import TensorParallel
    os.environ[ENV_OVERRIDE] = ("1", "0")[rank]
    os.environ[bf16_linear.ENV_SWITCH] = bf16_linear.FLOAT32
    torch.set_num_threads(1)
    tp = TensorParallel.initialize(rank, 2, init_method, torch.device("cpu"))
    runner = ModelRunner(EngineConfig(model=os.path.join(out_dir, "model"), dtype="bfloat16",
                                      tensor_parallel_size=2, num_gpu_blocks_override=8), tp)
    torch.save([runner.dtype, bf16_linear.route()], os.path.join(out_dir, f"rank{rank}.pt"))
    tp.shutdown()


def test_ranks_of_different_cpus_vote_alike(tmp_path):
    from test_shm_all_reduce import _run_group
    _bf16_model(tmp_path)
    per_rank = _run_group(tmp_path, _mixed_rank)
    assert [dtype for dtype, _ in per_rank] == [torch.bfloat16, torch.float32]
    assert {route for _, route in per_rank} == {bf16_linear.FLOAT32}
