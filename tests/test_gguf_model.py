"""A GGUF file run as it is: a tiny random Llama written with the `gguf` package, its tensors
of many types (three on q/k/v, K-quants, a type without a kernel, a float LM head). Kept in
blocks, its logits equal the dequantized float32 model's up to summation order and its greedy
tokens are the same at TP 1 and 2; `--model PATH.gguf` and hub ids resolve; bad files and
wrong `--quantization` fail at startup with one clear error, leaving no process behind."""
from __future__ import annotations

import logging
import os
import shutil

import gguf
import numpy as np
import psutil
import pytest
from gguf_utils import write_gguf
from model_utils import CORPUS, make_tiny_model
from quant_utils import prompt_logits, runner

from launch import LLM, SamplingParams
from launch.model_cache.gguf_model import materialize_gguf
from launch.processing.tokenizer import load_tokenizer
from worker.models.gguf_checkpoint import GGUFFileError

Q = gguf.GGMLQuantizationType
TYPES = {"q_proj": Q.Q4_K, "k_proj": Q.Q8_0, "v_proj": Q.Q6_K, "o_proj": Q.Q5_0,
         "gate_proj": Q.Q4_1, "up_proj": Q.Q4_1, "down_proj": Q.Q2_K, "embed_tokens": Q.Q8_0}
PROMPTS = ["def add(a, b):", "The quick brown", "print('hello"]


def _type(hf_name: str):
    """lm_head stays float32; down_proj's Q2_K has no kernel (dequantized at load)."""
    return TYPES.get(hf_name.rsplit(".", 2)[-2])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("tiny-gguf")
    hf = make_tiny_model(str(root / "hf"), tokenizer=True, hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    write_gguf(hf, str(root / "tiny.gguf"), _type)
    return str(root / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_dir(tiny_gguf, tmp_path_factory) -> str:
    return materialize_gguf(tiny_gguf, str(tmp_path_factory.mktemp("tiny-dir")))


def _prompt_ids(model_dir: str) -> list[int]:
    return load_tokenizer(model_dir).encode(CORPUS[:300])


def test_kept_blocks_give_the_dequantized_models_logits(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        kept = runner(tiny_dir, "auto")
    assert "dequantized to float32 at load: Q2_K (2 tensors)" in caplog.text
    assert kept.quantization == "gguf"
    assert kept.weights_summary.startswith("gguf (") and "Q6_K x2" in kept.weights_summary
    dense = runner(tiny_dir, "none")
    ids = _prompt_ids(tiny_dir)
    a, b = prompt_logits(kept, ids), prompt_logits(dense, ids)
    # Same weights, float32 sums in another order: differences at the float32 rounding scale.
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert dense.model.model.layers[0].mlp.down_proj.weight.dtype.is_floating_point


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_equal_dequantized(tiny_gguf, tp):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    tokens = {}
    for quantization in ("auto", "none"):
        with LLM(tiny_gguf, quantization=quantization, tensor_parallel_size=tp,
                 max_model_len=256, num_gpu_blocks_override=64) as llm:
            assert llm.inputs.ready.quantization.startswith(
                "gguf" if quantization == "auto" else "none")
            tokens[quantization] = [o.outputs[0].token_ids
                                    for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert tokens["auto"] == tokens["none"]


def _no_children() -> bool:
    """No engine process outlives its engine. Multiprocessing's resource tracker and
    forkserver (started once by any earlier spawn in this pytest process) do, by design."""
    def helper(child: psutil.Process) -> bool:
        try:
            command = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            return True
        return "resource_tracker" in command or "forkserver" in command
    return all(helper(c) for c in psutil.Process().children(recursive=True))


def _write_raw(path: str, architecture: str, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_head_count(1)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()


def test_llama3_rope_factors_without_scaling_are_refused(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), tokenizer=True)
    path = str(tmp_path / "rope.gguf")
    write_gguf(hf, path, extra={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(GGUFFileError, match="rope_freqs.weight"):
        LLM(path)
    assert _no_children()


def test_bad_files_fail_at_startup_naming_the_problem(tiny_gguf, tmp_path):
    truncated = str(tmp_path / "truncated.gguf")
    with open(tiny_gguf, "rb") as f:
        data = f.read()
    with open(truncated, "wb") as f:
        f.write(data[:len(data) * 2 // 3])
    _write_raw(str(tmp_path / "qwen2.gguf"), "qwen2",
               {"token_embd.weight": (np.zeros((4, 8), np.float32), Q.F32)})
    _write_raw(str(tmp_path / "q8k.gguf"), "llama",
               {"blk.0.ffn_up.weight": (np.zeros((4, 292), np.uint8), Q.Q8_K)})
    _write_raw(str(tmp_path / "stray.gguf"), "llama",
               {"blk.0.attn_qkv.weight": (np.zeros((4, 8), np.float32), Q.F32)})
    cases = {truncated: "truncated", str(tmp_path / "qwen2.gguf"):
             "general.architecture is 'qwen2'", str(tmp_path / "q8k.gguf"):
             "tensor 'blk.0.ffn_up.weight' has type Q8_K", str(tmp_path / "stray.gguf"):
             "tensor 'blk.0.attn_qkv.weight' has no place"}
    for path, message in cases.items():
        with pytest.raises(GGUFFileError, match=message):
            LLM(path)
        assert _no_children()


def test_wrong_quantization_fails_before_starting(tiny_gguf, tmp_path):
    dense = make_tiny_model(str(tmp_path / "dense"), tokenizer=True)
    with pytest.raises(ValueError, match="int8 quantizes a dense checkpoint"):
        LLM(tiny_gguf, quantization="int8")
    with pytest.raises(ValueError, match="gguf needs a GGUF model"):
        LLM(dense, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(dense, quantization="awq")
    assert _no_children()


def _hub_layout(hf_home: str, repo_id: str, files: dict[str, str]) -> str:
    """A snapshot as huggingface_hub lays one out (blobs, symlinked snapshot, refs/main)."""
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = os.path.join(repo, "snapshots", revision)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for name, source in files.items():
        blob = os.path.join(repo, "blobs", f"{abs(hash((repo_id, name))):x}")
        shutil.copyfile(source, blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    return snapshot


@pytest.mark.slow
def test_hub_ids_resolve_offline_from_the_cache(tiny_gguf, tmp_path, monkeypatch):
    from launch.model_cache.cache import resolve_model
    dense = make_tiny_model(str(tmp_path / "dense"), tokenizer=True)
    hf_home = str(tmp_path / "hf")
    monkeypatch.setenv("HF_HOME", hf_home)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path / "cache"))
    snapshot = _hub_layout(hf_home, "tiny-org/tiny-llama", {
        name: os.path.join(dense, name) for name in os.listdir(dense)})
    _hub_layout(hf_home, "tiny-org/tiny-GGUF", {"tiny.Q4_K.gguf": tiny_gguf})
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    gguf_dir = resolve_model("tiny-org/tiny-GGUF")
    assert gguf_dir.startswith(str(tmp_path / "cache" / "gguf"))
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        resolve_model("tiny-org/absent")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for name, reference in (("tiny-org/tiny-llama", dense), ("tiny-org/tiny-GGUF", tiny_gguf)):
        outs = []
        for model in (name, reference):
            with LLM(model, max_model_len=128, num_gpu_blocks_override=16) as llm:
                outs.append(llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0])
        assert outs[0].token_ids == outs[1].token_ids


@pytest.mark.slow
def test_server_names_the_quantization(tiny_gguf):
    """`/v1/models` and the engine's startup log line say how the weights run."""
    import httpx
    from server_utils import Server
    srv = Server(tiny_gguf, "--served-model-name", "tiny", "--max-model-len", "256",
                 "--num-gpu-blocks-override", "32")
    try:
        (model,) = httpx.get(srv.url + "/v1/models", timeout=10.0).json()["data"]
        assert model["quantization"].startswith("gguf (") and "Q6_K x2" in model["quantization"]
        (line,) = [ln for ln in srv.output().splitlines() if "model_config_info:" in ln]
        assert "quantization=gguf (" in line and "dtype=float32" in line
    finally:
        assert srv.stop() == 0, srv.output()
