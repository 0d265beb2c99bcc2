"""The native layer loop (worker/models/native_layer_loop.py) against the Python layer loop on
the same runner: a few requests prefilled, decoded together, and a step mixing both, every
hidden row and every written K/V slot equal bit for bit; GGUF (three
types merged into q/k/v, K-quants) and weight-only int8. Models it cannot take keep the loop."""
from __future__ import annotations

import gguf
import pytest
import torch
from gguf_utils import write_gguf
from model_utils import make_tiny_model
from quant_utils import runner

from launch.model_cache.gguf_model import materialize_gguf
from worker.attention.metadata import AttentionMetadata
from worker.models.native_layer_loop import NativeLayerLoop
from worker.native import cpu_decoder

Q = gguf.GGMLQuantizationType
TYPES = {"q_proj": Q.Q4_K, "k_proj": Q.Q8_0, "v_proj": Q.Q6_K, "o_proj": Q.Q5_0,
         "gate_proj": Q.Q4_1, "up_proj": Q.Q4_0, "down_proj": Q.Q6_K, "embed_tokens": Q.Q8_0}
BLOCK = 16

pytestmark = pytest.mark.skipif(
    cpu_decoder.load() is None,
    reason="the native kernels are unavailable here (no C++ compiler, or DELTASERVE_CPU_OPS=0)")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("native-loop")
    hf = make_tiny_model(str(root / "hf"), tokenizer=True, hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3)
    write_gguf(hf, str(root / "tiny.gguf"), lambda name: TYPES.get(name.rsplit(".", 2)[-2]))
    return materialize_gguf(str(root / "tiny.gguf"), str(root / "dir"))


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("native-int8") / "model"),
                           hidden_size=128, intermediate_size=256, num_hidden_layers=3)


def _metadata(query_lens: list[int], context_lens: list[int], tables: list[list[int]]):
    slots, positions = [], []
    for q, c, table in zip(query_lens, context_lens, tables):
        for p in range(c, c + q):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    metadata = AttentionMetadata(torch.tensor(slots), starts, torch.tensor(seq_lens,
                                 dtype=torch.int32), table, max(query_lens), max(seq_lens),
                                 list(query_lens), seq_lens)
    return metadata, torch.tensor(positions)


def _both(r, ids: torch.Tensor, positions: torch.Tensor, metadata) -> tuple:
    """(native hidden, its caches, loop hidden, its caches), the caches as bits (unwritten
    slots may hold NaNs); the loop rewrites the same slots."""
    model = r.model.model
    native, out = model.native_loop, []
    for loop in (native, False):
        model.native_loop = loop
        metadata.plan = None
        r.attention.plan(metadata)
        hidden = r.model(ids, positions, r.kv_caches, metadata)
        out += [hidden.clone(), [t.view(torch.int32).clone() for kv in r.kv_caches for t in kv]]
    model.native_loop = native
    return tuple(out)


def _step(r, query_lens: list[int], contexts: list[int], tables: list[list[int]],
          gen: torch.Generator) -> None:
    metadata, positions = _metadata(query_lens, contexts, tables)
    ids = torch.randint(0, 200, (sum(query_lens),), generator=gen)
    a, ca, b, cb = _both(r, ids, positions, metadata)
    assert torch.equal(a, b), f"{query_lens}: {(a - b).abs().max()}"
    assert all(torch.equal(x, y) for x, y in zip(ca, cb))


@torch.inference_mode()
def _check_equal_to_loop(r) -> int:
    """Prefill 6 requests (1 to 70 tokens: each product driver, and the loop past max_rows),
    decode them in batches of 1 to 6, then a step mixing decodes with a prefill chunk; returns
    the rows run through the native loop."""
    model = r.model.model
    model.native_loop = NativeLayerLoop.build(model)
    assert model.native_loop, "the model should be taken"
    native = model.native_loop
    gen = torch.Generator().manual_seed(0)
    prompt_lens = [3, 17, 1, 9, 30, 70]
    # 5 blocks of 16 each: blocks 1..30 (the runners below have 34)
    tables = [[1 + 5 * i + j for j in range(5)] for i in range(len(prompt_lens))]
    contexts = [0] * len(prompt_lens)
    rows = 0
    for i, n in enumerate(prompt_lens[:-1]):
        _step(r, [n], [0], [tables[i]], gen)
        rows += n if n <= native.max_rows else 0
        contexts[i] = n
    for step in range(6):
        batch = list(range(len(prompt_lens) - 1))[:1 + step % 5]
        _step(r, [1] * len(batch), [contexts[i] for i in batch], [tables[i] for i in batch],
              gen)
        for i in batch:
            contexts[i] += 1
        rows += len(batch)
    _step(r, [1, 1, 1, 9], [contexts[0], contexts[1], contexts[2], 0],
          [tables[0], tables[1], tables[2], tables[5]], gen)  # decodes + a chunk
    _step(r, [1, 70 - 9], [contexts[0] + 1, 9], [tables[0], tables[5]], gen)
    return rows + 12 + 62


def test_gguf_model_equals_the_python_loop(gguf_dir):
    r = runner(gguf_dir, "gguf", max_model_len=512)
    assert _check_equal_to_loop(r) > 6


def test_int8_model_equals_the_python_loop(float_dir):
    r = runner(float_dir, "int8", max_model_len=512)
    assert _check_equal_to_loop(r) > 6


def test_unquantized_and_tensor_parallel_models_keep_the_loop(float_dir):
    """Dense float32 linear layers have no native weights: the loop runs them (oneDNN)."""
    r = runner(float_dir, "none", max_model_len=128)
    assert NativeLayerLoop.build(r.model.model) is None


def test_more_rows_than_it_takes_go_through_the_loop(gguf_dir):
    r = runner(gguf_dir, "gguf", max_model_len=512)
    loop = NativeLayerLoop.build(r.model.model)
    assert loop.takes(loop.max_rows, r.kv_caches)
    assert not loop.takes(loop.max_rows + 1, r.kv_caches)
    assert not loop.takes(0, r.kv_caches)


@torch.inference_mode()
def test_a_position_outside_the_rotary_table_is_an_index_error(gguf_dir):
    """Every thread of the native call stops at the same step; the next call works."""
    r = runner(gguf_dir, "gguf", max_model_len=512)
    model = r.model.model
    model.native_loop = NativeLayerLoop.build(model)
    metadata, _ = _metadata([1], [0], [[1]])
    r.attention.plan(metadata)
    with pytest.raises(IndexError, match="rotary"):
        r.model(torch.tensor([5]), torch.tensor([10 ** 6]), r.kv_caches, metadata)
    metadata.plan = None
    r.attention.plan(metadata)
    hidden = r.model(torch.tensor([5]), torch.tensor([0]), r.kv_caches, metadata)
    assert hidden.isfinite().all()
