"""The native layer loop (worker/models/native_layer_loop.py) against the Python layer loop on
the same runner: a few requests prefilled, decoded together, and a step mixing both, every
hidden row and every written K/V slot equal bit for bit; GGUF (three
types merged into q/k/v, K-quants) and weight-only int8. Models it cannot take keep the loop.
At tensor parallel 2 (two real rank processes over gloo and the shm all-reduce, 3 KV heads
split 2 + 1) each rank's rows and K/V equal its Python loop's bit for bit; engines at TP=2 (a
tiny GGUF model and SmolLM2) log that both ranks took it and give the Python loop's tokens and
log-probabilities."""
from __future__ import annotations

import multiprocessing
import os

import gguf
import pytest
import torch
from gguf_utils import write_gguf
from model_utils import fetched_model, make_tiny_model
from quant_utils import runner

from launch import LLM, SamplingParams
from launch.model_cache.gguf_model import materialize_gguf
from protocol import EngineConfig
from worker.attention.metadata import AttentionMetadata
from worker.distributed.tensor_parallel import TensorParallel
from worker.layers import bf16_linear
from worker.model_runner import ModelRunner
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


# 32-element blocks only: a rank's o_proj input (its query heads, 4 or 2 of 6 x 32) must be
# whole blocks. Three types merged into q/k/v, two into gate/up.
TP_TYPES = {"q_proj": Q.Q4_0, "k_proj": Q.Q8_0, "v_proj": Q.Q5_1, "o_proj": Q.Q5_0,
            "gate_proj": Q.Q4_1, "up_proj": Q.Q4_0, "down_proj": Q.Q8_0, "embed_tokens": Q.Q8_0}
UNEVEN = dict(hidden_size=192, intermediate_size=384, num_attention_heads=6,
              num_key_value_heads=3, num_hidden_layers=3)  # head_dim 32, KV heads 2 + 1


@pytest.fixture(scope="module")
def uneven_gguf(tmp_path_factory) -> str:
    """A GGUF file whose 3 KV heads split 2 + 1 over two ranks."""
    root = tmp_path_factory.mktemp("native-loop-tp")
    hf = make_tiny_model(str(root / "hf"), tokenizer=True, **UNEVEN)
    write_gguf(hf, str(root / "tiny.gguf"), lambda name: TP_TYPES.get(name.rsplit(".", 2)[-2]))
    return str(root / "tiny.gguf")


@pytest.fixture(scope="module")
def uneven_dir(uneven_gguf, tmp_path_factory) -> str:
    return materialize_gguf(uneven_gguf, str(tmp_path_factory.mktemp("native-loop-tp-dir")))


@pytest.fixture(scope="module")
def uneven_float_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("native-int8-tp") / "model"),
                           **{**UNEVEN, "hidden_size": 96})


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


BF16_SHAPE = dict(num_hidden_layers=3, hidden_size=128)
MOE_SHAPES = {"qwen3_moe": {**BF16_SHAPE, "mlp_only_layers": [1]}}  # sparse, dense, sparse


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "llama"])
def bf16_dir(request, tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp(f"native-bf16-{request.param}") / "m"),
                           request.param, **MOE_SHAPES.get(request.param, BF16_SHAPE))


def bf16_runner(model_dir: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model=model_dir, dtype="bfloat16", max_model_len=512,
                                    max_num_seqs=1, num_gpu_blocks_override=34))


def _taken_or_skip(model) -> NativeLayerLoop:
    loop = NativeLayerLoop.build(model)
    if loop is None and bf16_linear.route() != bf16_linear.FLOAT32:
        pytest.skip("bf16 linears multiply in bf16 here (oneDNN): the native loop does not "
                    "take them")
    assert loop is not None, "the model should be taken"
    return loop


def test_bf16_models_equal_the_python_loop(bf16_dir):
    """bf16 weights on the float32 route (dense driver rows, float32 outputs): a Qwen3-MoE
    (sparse, dense and sparse layers: the experts between parallel regions, routed natively),
    Mixtral, and a dense Llama; bf16-rounded norms before each MoE block, a bf16 KV cache.
    Every hidden row and K/V slot equals the Python loop's."""
    r = bf16_runner(bf16_dir)
    loop = _taken_or_skip(r.model.model)
    assert loop.max_rows < bf16_linear.dense_float32_rows()  # oneDNN's float32 copy from there
    assert r.kv_caches[0][0].dtype == torch.bfloat16
    assert _check_equal_to_loop(r) > 6
    # 5 prefills up to 30 rows, 6 decodes, 1 mixed; and the 62-row step where the dense
    # driver takes 62 rows (DELTASERVE_BF16_COPY_ROWS past it)
    assert r.model.model.native_loop.steps == (13 if loop.max_rows >= 62 else 12)


@pytest.mark.parametrize("arch,quantization", [("qwen3_moe", "int8"), ("mixtral", "w8a8")])
def test_quantized_moe_models_equal_the_python_loop(tmp_path, arch, quantization):
    """Weight-only int8 / w8a8 MoE models (float32 layers, int8 experts and router): the
    experts between the regions, prefill chunks up to max_rows too (the kernel's grouped
    products)."""
    model_dir = make_tiny_model(str(tmp_path / "m"), arch, **MOE_SHAPES.get(arch, BF16_SHAPE))
    r = runner(model_dir, quantization, max_model_len=512)
    assert _check_equal_to_loop(r) > 6
    assert r.model.model.native_loop.steps == 13


def test_a_shared_expert_keeps_the_loop(tmp_path):
    """Qwen2-MoE (q/k/v biases, a shared expert with its gate): the Python loop."""
    r = bf16_runner(make_tiny_model(str(tmp_path / "m"), "qwen2_moe", **BF16_SHAPE))
    assert NativeLayerLoop.build(r.model.model) is None


def test_unquantized_models_keep_the_loop(float_dir):
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


def _tp_rank(rank: int, init_method: str, model_dir: str, quantization: str, out: str) -> None:
    """One rank of a TP=2 group: its native loop against its Python loop, step by step (the
    peers' all-reduces pair up across both loops: the same sequence numbers). int8 ranks run
    a team of 2 threads (one of them sums, the team waits at the single's barrier)."""
    torch.set_num_threads(2 if quantization in ("int8", "bf16") else 1)
    if quantization == "noshm":
        os.environ["DELTASERVE_SHM_ALLREDUCE"] = "0"
    tp = TensorParallel.initialize(rank, 2, init_method, torch.device("cpu"), timeout_s=30.0)
    dtype = "bfloat16" if quantization == "bf16" else "auto"
    quantization = {"noshm": "int8", "bf16": "none"}.get(quantization, quantization)
    config = EngineConfig(model=model_dir, max_model_len=512, max_num_seqs=1, dtype=dtype,
                          num_gpu_blocks_override=34, tensor_parallel_size=2,
                          quantization=quantization)
    r = ModelRunner(config, tp)
    attn = r.model.model.layers[0].self_attn
    result = {"heads": (attn.num_heads, attn.num_kv_heads)}
    if config.quantization == "int8" and os.environ.get("DELTASERVE_SHM_ALLREDUCE") == "0":
        result["built"] = NativeLayerLoop.build(r.model.model) is not None
    elif dtype == "bfloat16" and NativeLayerLoop.build(r.model.model) is None:
        result["route"] = bf16_linear.route()
    else:
        result["rows"] = _check_equal_to_loop(r)
        result["steps"], result["seq"] = r.model.model.native_loop.steps, tp.shm.next_seq
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    tp.shutdown()


def _tp_group(tmp_path, model_dir: str, quantization: str) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path}/rendezvous"
    procs = [context.Process(target=_tp_rank, args=(r, init, model_dir, quantization,
                                                     str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_tensor_parallel_ranks_equal_their_python_loop(uneven_dir, uneven_float_dir, tmp_path,
                                                       quantization):
    """3 KV heads over 2 ranks: rank 0 holds 2 KV heads and 4 query heads, rank 1 one and
    two; each rank's native loop (its own shards, the sums from inside the call) gives its
    Python loop's hidden rows and K/V bit for bit, and both ranks end on the same sequence
    number."""
    model_dir = uneven_dir if quantization == "gguf" else uneven_float_dir
    ranks = _tp_group(tmp_path, model_dir, quantization)
    assert [r["heads"] for r in ranks] == [(4, 2), (2, 1)]
    for r in ranks:
        assert r["rows"] > 6 and r["steps"] == 13  # 5 prefills, 6 decodes, 2 mixed
    assert ranks[0]["seq"] == ranks[1]["seq"]


@pytest.fixture(scope="module")
def uneven_moe_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("native-moe-tp") / "m"), "qwen3_moe",
                           **{**UNEVEN, "mlp_only_layers": [1]})


@pytest.mark.slow
def test_tensor_parallel_bf16_moe_ranks_equal_their_python_loop(uneven_moe_dir, tmp_path):
    """A bf16 Qwen3-MoE at TP 2, 3 KV heads split 2 + 1, each expert's intermediate split in
    halves: each rank's native loop (the experts' partial sums reduced from inside the call,
    as a dense MLP's down_proj) equals its Python loop bit for bit."""
    ranks = _tp_group(tmp_path, uneven_moe_dir, "bf16")
    if any("route" in r for r in ranks):
        pytest.skip(f"bf16 linears multiply in bf16 here: {[r.get('route') for r in ranks]}")
    assert [r["heads"] for r in ranks] == [(4, 2), (2, 1)]
    # the 61-row chunk: native where the dense driver takes 61 rows (AVX-512's bf16_panels)
    steps = 13 if bf16_linear.dense_float32_rows() > 61 else 12
    for r in ranks:
        assert r["rows"] > 6 and r["steps"] == steps
    assert ranks[0]["seq"] == ranks[1]["seq"]


@pytest.mark.slow
def test_tensor_parallel_without_the_shm_all_reduce_keeps_the_python_loop(uneven_float_dir,
                                                                            tmp_path):
    ranks = _tp_group(tmp_path, uneven_float_dir, "noshm")
    assert [r["built"] for r in ranks] == [False, False]


def _greedy(model: str, tp: int, prompts: list, native: bool, monkeypatch, **options) -> list:
    """(token ids, log-probabilities) per prompt from an engine (its workers inherit the
    environment: DELTASERVE_NATIVE_LAYERS=0 keeps the Python loop)."""
    monkeypatch.setenv("DELTASERVE_NATIVE_LAYERS", "1" if native else "0")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(model, tensor_parallel_size=tp, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                       o.outputs[0].logprobs)])
            for o in outs]


def _assert_both_ranks_took_it(capfd) -> None:
    err = capfd.readouterr().err
    assert "native layer loop: first step" in err, err[-2000:]
    for rank in (0, 1):
        assert f"tensor-parallel rank {rank} of 2" in err, err[-2000:]


@pytest.mark.slow
def test_tp2_engine_takes_the_native_loop_with_uneven_kv_heads(uneven_gguf, monkeypatch,
                                                                capfd):
    """Real worker processes: TP=2 with the native loop gives the TP=2 Python loop's tokens
    and log-probabilities exactly (the same kernels and sums) and TP=1's tokens."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(40, 110))},
               {"prompt_token_ids": [42]}]
    options = dict(max_model_len=256, num_gpu_blocks_override=64)
    capfd.readouterr()
    native = _greedy(uneven_gguf, 2, prompts, True, monkeypatch, **options)
    _assert_both_ranks_took_it(capfd)
    assert _greedy(uneven_gguf, 2, prompts, False, monkeypatch, **options) == native
    assert "native layer loop" not in capfd.readouterr().err
    single = _greedy(uneven_gguf, 1, prompts, True, monkeypatch, **options)
    assert [t for t, _ in single] == [t for t, _ in native]
    for (_, a), (_, b) in zip(single, native):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


@pytest.mark.slow
def test_tp2_engine_takes_the_native_loop_with_a_bf16_moe(uneven_moe_dir, monkeypatch, capfd):
    """A bf16 Qwen3-MoE served at TP=2 by real worker processes: both ranks take the native
    loop, and its tokens and log-probabilities are the Python loop's."""
    if not bf16_linear.products_slow(torch.bfloat16):
        pytest.skip("bf16 products are not slower than float32 FMAs here: bf16 linears "
                    "multiply through oneDNN, which the native loop does not take")
    monkeypatch.setenv("DELTASERVE_BF16_LINEARS", "float32")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(40, 70))},
               {"prompt_token_ids": [42]}]
    options = dict(max_model_len=256, num_gpu_blocks_override=64, dtype="bfloat16")
    capfd.readouterr()
    native = _greedy(uneven_moe_dir, 2, prompts, True, monkeypatch, **options)
    _assert_both_ranks_took_it(capfd)
    assert _greedy(uneven_moe_dir, 2, prompts, False, monkeypatch, **options) == native
    assert "native layer loop" not in capfd.readouterr().err


@pytest.mark.slow
def test_tp2_smollm2_takes_the_native_loop(monkeypatch, capfd):
    """The demo model (9 query heads, 3 KV heads: 6 + 3 and 2 + 1 per rank, Q4_1) at TP=2:
    the native loop's tokens and log-probabilities are the Python loop's."""
    model = fetched_model("smollm2", "SmolLM2")
    prompts = ["def fibonacci(n):", "The capital of France is"]
    options = dict(max_model_len=256, kv_cache_memory_bytes=1 << 26)
    capfd.readouterr()
    native = _greedy(model, 2, prompts, True, monkeypatch, **options)
    _assert_both_ranks_took_it(capfd)
    assert _greedy(model, 2, prompts, False, monkeypatch, **options) == native
