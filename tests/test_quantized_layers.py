"""The GGUF and int8 weight methods through the tensor-parallel layers, against
dequantize-then-float32 products: every kernel type, one row and many, odd sizes, merged
layers whose parts differ in type, column and row splits over two ranks (partial sums added
as the all-reduce would), the embedding and LM head; int8 rows and scales."""
from __future__ import annotations

import pytest
import torch
from test_gguf_kernels import assert_within_summation_error

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker.layers.quantization.gguf import GGUFConfig
from worker.layers.quantization.int8 import Int8Config, int8_matmul, quantize_rows
from worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from worker.native import gguf_ops

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _blocks(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    return gguf_ops.random_blocks(qtype, n, k, torch.Generator().manual_seed(seed))


def _dense(w: torch.Tensor, qtype: str, n: int, k: int) -> torch.Tensor:
    return gguf_ops.dequantize_reference(w, qtype, n, k)


def _config(types: dict[str, str], tied: bool = False) -> GGUFConfig:
    return GGUFConfig({name: gguf_ops.gguf_type(t) for name, t in types.items()}, PACKED, tied)


def _finish(layer) -> None:
    layer.quant_method.process_weights_after_loading(layer)


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 7, 40])
def test_column_parallel_one_rank_and_two(qtype, m):
    k = gguf_ops.GGUF_TYPES[qtype].block_elems * 2
    n = 22
    w = _blocks(qtype, n, k, seed=m)
    dense = _dense(w, qtype, n, k)
    x = _x(m, k)
    for world in (1, 2):
        parts = []
        for rank in range(world):
            layer = ColumnParallelLinear(k, n, TensorParallel(rank, world),
                                         quant_config=_config({"p.weight": qtype}), prefix="p")
            layer.weight_loader(layer.weight, w)
            _finish(layer)
            parts.append(layer(x))
        assert_within_summation_error(torch.cat(parts, dim=1), x, dense)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 9])
def test_row_parallel_splits_whole_blocks(qtype, m):
    block = gguf_ops.GGUF_TYPES[qtype].block_elems
    k, n = block * 4, 19
    w = _blocks(qtype, n, k, seed=m)
    x = _x(m, k)
    total = torch.zeros(m, n)
    for rank, shard in enumerate([(0, block * 3), (block * 3, block)]):  # uneven, as o_proj
        layer = RowParallelLinear(k, n, TensorParallel(rank, 2), shard=shard,
                                  quant_config=_config({"p.weight": qtype}), prefix="p")
        layer.weight_loader(layer.weight, w)
        _finish(layer)
        total += layer.quant_method.apply(layer, x[:, shard[0]:sum(shard)])
    assert_within_summation_error(total, x, _dense(w, qtype, n, k))


def test_row_parallel_refuses_a_split_inside_a_block():
    with pytest.raises(ValueError, match=r"layers\.0\.down.*cut Q4_K's blocks of 256"):
        RowParallelLinear(512, 8, TensorParallel(1, 2), shard=(128, 384),
                          quant_config=_config({"layers.0.down.weight": "Q4_K"}),
                          prefix="layers.0.down")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_merged_parts_of_different_types(world, m):
    """q/k/v of three types (three segments) and gate/up of one (one call), TP 1 and 2."""
    k, d = 256, 32
    types = {"a.q_proj.weight": "Q4_K", "a.k_proj.weight": "Q8_0", "a.v_proj.weight": "Q6_K",
             "a.gate_proj.weight": "Q4_1", "a.up_proj.weight": "Q4_1"}
    rows = {"q": 4 * d, "k": 2 * d, "v": 2 * d, "gate": 48, "up": 48}
    w = {p: _blocks(types[f"a.{p}_proj.weight"], r, k, seed=i) for i, (p, r) in
         enumerate(rows.items())}
    dense = {p: _dense(w[p], types[f"a.{p}_proj.weight"], rows[p], k) for p in rows}
    x = _x(m, k)
    for rank in range(world):
        tp = TensorParallel(rank, world)
        qkv = QKVParallelLinear(k, d, 4, 2, tp, quant_config=_config(types), prefix="a.qkv_proj")
        gate_up = MergedColumnParallelLinear(k, [48, 48], tp, quant_config=_config(types),
                                             prefix="a.gate_up_proj")
        for part in "qkv":
            raw = w[part]
            padded = torch.nn.functional.pad(raw, (0, qkv.weight.shape[1] - raw.shape[1]))
            qkv.weight_loader(qkv.weight, padded, part)
        for i, part in enumerate(("gate", "up")):
            gate_up.weight_loader(gate_up.weight, w[part], i)
        _finish(qkv)
        _finish(gate_up)
        assert len(qkv.gguf_segments) == 3 and len(gate_up.gguf_segments) == 1
        h, kv = 4 // world, 2 // world
        want = torch.cat([dense["q"][rank * h * d:(rank + 1) * h * d],
                          dense["k"][rank * kv * d:(rank + 1) * kv * d],
                          dense["v"][rank * kv * d:(rank + 1) * kv * d]])
        assert_within_summation_error(qkv(x), x, want)
        half = 48 // world
        want = torch.cat([dense[p][rank * half:(rank + 1) * half] for p in ("gate", "up")])
        assert_within_summation_error(gate_up(x), x, want)


@pytest.mark.parametrize("world", [1, 2])
def test_embedding_and_tied_lm_head(world):
    vocab, hidden = 37, 64  # 37 rows: the last rank's slice is padded
    w = _blocks("Q8_0", vocab, hidden, seed=3)
    dense = _dense(w, "Q8_0", vocab, hidden)
    config = _config({"model.embed_tokens.weight": "Q8_0"}, tied=True)
    ids = torch.tensor([0, 36, 5, 18, 19])
    x = _x(3, hidden)
    logits = []
    for rank in range(world):
        tp = TensorParallel(rank, world)
        embed = VocabParallelEmbedding(vocab, hidden, tp, config, "model.embed_tokens")
        head = ParallelLMHead(vocab, hidden, tp, config, "lm_head")
        embed.weight_loader(embed.weight, w)
        head.weight = embed.weight  # tied, as the model ties them
        _finish(embed)
        _finish(head)
        lo, rows = embed.vocab_start, embed.rows_per_rank
        owned = (ids >= lo) & (ids < lo + rows)
        got = embed.quant_method.embedding(embed, (ids - lo).clamp(0, rows - 1))
        assert torch.equal(got[owned], dense[ids[owned]])
        logits.append(head.quant_method.apply(head, x))
    assert_within_summation_error(torch.cat(logits, dim=1)[:, :vocab], x, dense)


@pytest.mark.parametrize("k", [64, 96, 40])  # 40: not whole blocks of 32 (torch's kernel)
@pytest.mark.parametrize("m", [1, 6, 50])
def test_int8_rows_and_scales(k, m):
    w = torch.randn(29, k, generator=torch.Generator().manual_seed(k)) * 0.05
    w[3] = 0.0  # an all-zero row
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale[3] == 1.0
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 * (1 + 1e-6)
    x = _x(m, k)
    dense = q.float() * scale[:, None]
    y = int8_matmul(x, q, scale)
    # the kernel scales each sum once more than the reference: one more rounding
    assert_within_summation_error(y, x, dense * (1 + 2.0 ** -23))


def test_int8_linear_layer_quantizes_at_load():
    k, n = 64, 24
    w = torch.randn(n, k) * 0.1
    layer = ColumnParallelLinear(k, n, TensorParallel(), quant_config=Int8Config(), prefix="p")
    layer.weight_loader(layer.weight, w)
    _finish(layer)
    assert layer.weight.dtype == torch.int8 and layer.compute_dtype == torch.float32
    x = _x(4, k)
    torch.testing.assert_close(layer(x), x @ w.T, atol=0.02, rtol=0.05)
