"""The fused MoE kernel and layer: results equal the per-expert torch reference (dense float32,
bfloat16, float16, GGUF blocks, int8) at decode and prefill row counts with uneven routing;
Hugging Face's router semantics; a tensor-parallel split's partial sums add up to the whole;
bad expert ids are refused; the AVX2 build agrees."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.fused_moe.layer import FusedMoE
from worker.layers.fused_moe.router import select_experts
from worker.layers.quantization.int8 import Int8Config
from worker.native import fused_moe, gguf_ops

E, H, I = 8, 64, 96  # experts, hidden, intermediate: inter is not a multiple of DOT_GROUP * 8


def _routing(tokens: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven: expert e's logits spread 1 + e wide, so later experts are picked more often."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g) * (1 + torch.arange(E))
    return select_experts(logits, top_k, renormalize=True)


def _dense_experts(dtype: torch.dtype, seed: int = 0) -> fused_moe.FusedExperts:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    return fused_moe.bind_stacked(w13, w2, H)


def _gguf_experts(names: tuple[str, str, str], hidden: int, inter: int) -> fused_moe.FusedExperts:
    """Gate, up and down of the given types; gate and up share one zero-padded tensor."""
    g = torch.Generator().manual_seed(1)
    gate, up, down = (gguf_ops.gguf_type(n) for n in names)
    width = max(gate.row_bytes(hidden), up.row_bytes(hidden))
    w13 = torch.zeros(E, 2 * inter, width, dtype=torch.uint8)
    for t, rows in ((gate, slice(0, inter)), (up, slice(inter, 2 * inter))):
        blocks = gguf_ops.random_blocks(t.name, E * inter, hidden, g, scale=2.0 ** -8)
        w13[:, rows, :t.row_bytes(hidden)] = blocks.view(E, inter, -1)
    w2 = gguf_ops.random_blocks(down.name, E * hidden, inter, g, scale=2.0 ** -8)
    return fused_moe.bind_stacked(w13, w2.view(E, hidden, -1), hidden,
                                  (gate.code, up.code, down.code))


def _check(experts: fused_moe.FusedExperts, tokens: int, top_k: int = 3) -> None:
    assert experts.is_native
    x = torch.randn(tokens, experts.hidden)
    weights, ids = _routing(tokens, top_k, seed=tokens)
    ours = experts(x, weights, ids)
    ref = fused_moe.experts_reference(x, weights, ids, experts)
    # bf16 experts round the SiLU product to bf16: the kernel's SiLU and torch's differ in
    # the last float32 bits, so an element near a rounding boundary may round the other
    # way, one bf16 step (2^-8 relative) of one term of a down product
    atol = (2.0 ** -8 if experts.down.code == fused_moe.BF16_CODE else 1e-5) * ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("tokens", [1, 2, 5, 17, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_experts_equal_the_reference(dtype, tokens):
    """1-5 tokens: every expert few rows (the decode units); 17 and 130: some experts past
    DOT_ROWS rows (the strips driver), the rest still in units."""
    _check(_dense_experts(dtype), tokens)


@pytest.mark.parametrize("names,hidden,inter", [
    (("Q4_0", "Q4_0", "Q8_0"), 64, 64), (("Q4_1", "Q5_0", "Q5_1"), 64, 96),
    (("Q4_K", "Q4_K", "Q6_K"), 256, 256), (("Q5_K", "Q8_0", "Q4_K"), 256, 256)])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_gguf_experts_equal_the_dequantized_reference(names, hidden, inter, tokens):
    """Same-type gate/up run as one matrix, mixed types as two; down of a third type."""
    _check(_gguf_experts(names, hidden, inter), tokens, top_k=2)


def test_accumulate_adds_and_threads_do_not_change_bits():
    experts = _dense_experts(torch.float32)
    x = torch.randn(33, H)
    weights, ids = _routing(33, 3)
    base = torch.randn(33, H)
    once = experts(x, weights, ids)
    torch.testing.assert_close(experts(x, weights, ids, out=base.clone(), accumulate=True),
                               base + once, rtol=1e-6, atol=1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = experts(x, weights, ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, once)
    # decode-sized steps (each expert at most 4 rows): a token's bits do not depend on the
    # other tokens of the step
    step = experts(x[:4], weights[:4], ids[:4])
    for t in range(4):
        assert torch.equal(experts(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]), step[t:t + 1])


def _at_both_thread_counts(experts, x, weights, ids, threads):
    """The experts' output at `threads` threads, and at the other count (1 <-> 2)."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ours = experts(x, weights, ids)
        torch.set_num_threads(3 - threads)
        return ours, experts(x, weights, ids)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_decode_units_every_row_count(threads):
    """bf16 experts of 1 to 8 rows each (every decode tile's row count; with AVX-512 the split
    float rows of x and of the SiLU product), K of several 32-element lines, at 1 and 2
    threads: the reference's values, and the same bits whatever the thread count."""
    g = torch.Generator().manual_seed(3)
    hidden, inter, experts_n = 128, 160, 8
    w13 = (torch.randn(experts_n, 2 * inter, hidden, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(experts_n, hidden, inter, generator=g) * 0.1).bfloat16()
    experts = fused_moe.bind_stacked(w13, w2, hidden)
    # expert e on e + 1 rows (36 in all), 9 tokens x 4 choices: ids[t, j] = order[9 j + t],
    # so a token's choices are 9 apart in `order` and name 4 different experts
    order = [e for e in range(experts_n) for _ in range(e + 1)]
    ids = torch.tensor(order, dtype=torch.int32).view(4, 9).T.contiguous()
    weights = torch.rand(9, 4, generator=g)
    x = torch.randn(9, hidden, generator=g)
    ours, other = _at_both_thread_counts(experts, x, weights, ids, threads)
    ref = fused_moe.experts_reference(x, weights, ids, experts)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=2.0 ** -8 * ref.abs().max().item())
    assert torch.equal(ours, other)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_rows_per_expert_up_to_64(dtype, threads):
    """Experts of 1 to 64 rows each, uneven (bf16 decode units in passes of at most 4 x rows,
    past DOT_ROWS the grouped product), at 1 and 2 threads: the reference's values, and the
    same bits whatever the thread count."""
    g = torch.Generator().manual_seed(4)
    hidden, inter = 128, 96
    counts = [1, 2, 3, 4, 5, 6, 7, 8, 9, 18, 16, 17, 31, 32, 33, 64]  # 256 rows
    w13 = (torch.randn(len(counts), 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(len(counts), hidden, inter, generator=g) * 0.1).to(dtype)
    experts = fused_moe.bind_stacked(w13, w2, hidden)
    # 64 tokens x 4 choices, ids[t, j] = order[64 j + t]: no expert has more than 64 rows, so
    # a token's 4 choices name 4 different experts
    order = [e for e, n in enumerate(counts) for _ in range(n)]
    ids = torch.tensor(order, dtype=torch.int32).view(4, 64).T.contiguous()
    weights = torch.rand(64, 4, generator=g)
    x = torch.randn(64, hidden, generator=g)
    ours, other = _at_both_thread_counts(experts, x, weights, ids, threads)
    ref = fused_moe.experts_reference(x, weights, ids, experts)
    bound = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=bound * ref.abs().max().item())
    assert torch.equal(ours, other)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused_gate_up", [True, False])
@pytest.mark.parametrize("inter", [96, 40])
def test_bf16_prefill_products_blocks_chunks_and_edges(fused_gate_up, threads, inter):
    """bf16 experts of hundreds of rows (prefill; with AVX-512 the panel route, gate and up
    paired): an expert of 600 rows (two row blocks), K of a whole and a partial 128-element
    chunk (hidden 176: the first chunk's sums kept aside, added in the last), outputs of a
    partial 64-row strip (down's 176) and of whole and partial paired strips of 32 gate and
    32 up rows (inter 96, 40), row counts not a multiple of the 6-row tile, gate and up one
    matrix or two: the reference's values, and the same bits whatever the thread count."""
    g = torch.Generator().manual_seed(5)
    hidden, tokens = 176, 600
    w13 = (torch.randn(3, 2 * inter, hidden, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(3, hidden, inter, generator=g) * 0.1).bfloat16()
    if fused_gate_up:
        experts = fused_moe.bind_stacked(w13, w2, hidden)
    else:
        gate, up = w13[:, :inter].clone(), w13[:, inter:].clone()
        experts = fused_moe.FusedExperts(fused_moe.ExpertMatrices(gate),
                                         fused_moe.ExpertMatrices(up),
                                         fused_moe.ExpertMatrices(w2), hidden, inter)
    # every token on expert 0 (600 rows) and on expert 1 or 2 (299 and 301 rows)
    second = 1 + (torch.arange(tokens) % 2 + (torch.arange(tokens) == 0)).clamp(max=1)
    ids = torch.stack([torch.zeros(tokens, dtype=torch.long), second], 1).to(torch.int32)
    weights = torch.rand(tokens, 2, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    ours, other = _at_both_thread_counts(experts, x, weights, ids, threads)
    ref = fused_moe.experts_reference(x, weights, ids, experts)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=2.0 ** -8 * ref.abs().max().item())
    assert torch.equal(ours, other)


def test_huge_pages_keep_the_weights(monkeypatch):
    """Backing expert weights with transparent huge pages (best effort) changes no value."""
    t = torch.randn(3 << 20)  # 12 MB: at least four whole 2 MB pages inside
    before = t.clone()
    collapsed = fused_moe.back_with_huge_pages(t)
    assert 0 <= collapsed <= t.numel() * 4 and collapsed % (2 << 20) == 0
    assert torch.equal(t, before)
    monkeypatch.setenv("DELTASERVE_MOE_HUGE_PAGES", "0")
    assert fused_moe.back_with_huge_pages(t) == 0


def test_bad_expert_ids_are_refused():
    experts = _dense_experts(torch.float32)
    x = torch.randn(2, H)
    weights, ids = _routing(2, 2)
    for bad in (E, -1):
        ids[1, 1] = bad
        with pytest.raises(RuntimeError, match="expert id outside"):
            experts(x, weights, ids)
        with pytest.raises(RuntimeError, match="expert id outside"):
            fused_moe.experts_reference(x, weights, ids, experts)


def test_router_is_hugging_faces():
    """Softmax in float32 over all experts, top-k, renormalized or not (Qwen3-MoE's router)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    for norm in (True, False):
        config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=3,
                                norm_topk_prob=norm)
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        x = torch.randn(11, H)
        logits, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(F.linear(x, router.weight), 3, norm)
        assert torch.equal(ids, hf_ids.int())
        torch.testing.assert_close(weights, hf_weights)


def _layer(gate, up, down, rank=0, world=1, config=None) -> FusedMoE:
    """Gate and up loaded one expert at a time (Hugging Face's layout), down stacked (GGUF's)."""
    layer = FusedMoE(E, 3, H, I, TensorParallel(rank, world), True, config, "experts")
    for e in range(E):
        layer.weight_loader(layer.w13_weight, gate[e], (e, "w1"))
        layer.weight_loader(layer.w13_weight, up[e], (e, "w3"))
    layer.weight_loader(layer.w2_weight, down, (None, "w2"))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _weights_and_inputs():
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(E, I, H, generator=g) * 0.1, torch.randn(E, I, H, generator=g) * 0.1
    down = torch.randn(E, H, I, generator=g) * 0.1
    return (gate, up, down), torch.randn(7, H), torch.randn(7, E) * (1 + torch.arange(E))


def test_tensor_parallel_ranks_sum_to_the_whole():
    """Each rank holds its slice of every expert's intermediate dimension (48 of 96: the
    products run in the torch fallback, as 48 is not whole blocks of 32 for the kernel); the
    ranks' partial sums add up to one rank's result. transformers 5's fused gate_up tensor
    loads the same weights."""
    weights, x, logits = _weights_and_inputs()
    whole = _layer(*weights)(x, logits)
    halves = [_layer(*weights, rank, 2)(x, logits) for rank in (0, 1)]
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=1e-5)
    gate, up, down = weights
    fused = FusedMoE(E, 3, H, I, TensorParallel(0, 1), True, None, "experts")
    fused.weight_loader(fused.w13_weight, torch.cat([gate, up], 1), (None, "w13"))
    fused.weight_loader(fused.w2_weight, down, (None, "w2"))
    fused.quant_method.process_weights_after_loading(fused)
    assert torch.equal(fused(x, logits), whole)


def test_int8_experts_stay_close_to_float():
    weights, x, logits = _weights_and_inputs()
    dense = _layer(*weights)(x, logits)
    layer = _layer(*weights, config=Int8Config())
    assert layer.w13_weight.dtype == torch.int8 and layer.fused_experts.is_native
    assert (layer(x, logits) - dense).abs().max() < 0.02 * dense.abs().max()


def test_falls_back_to_torch_without_a_compiler(monkeypatch):
    monkeypatch.setattr(fused_moe, "native", lambda: None)
    experts = _dense_experts(torch.float32)
    assert not experts.is_native
    x = torch.randn(4, H)
    weights, ids = _routing(4, 3)
    torch.testing.assert_close(experts(x, weights, ids),
                               fused_moe.experts_reference(x, weights, ids, experts))


@pytest.mark.slow
def test_avx2_build_agrees(monkeypatch):
    """The x86-64-v3 (AVX2, 8-lane, 4 decode rows) build of the same source."""
    monkeypatch.setattr(fused_moe, "native", lambda: fused_moe.load("x86-64-v3"))
    for tokens in (1, 3, 6, 40):
        _check(_dense_experts(torch.bfloat16), tokens)
        _check(_gguf_experts(("Q4_K", "Q4_K", "Q6_K"), 256, 256), tokens, top_k=2)
