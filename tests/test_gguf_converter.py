"""GGUF -> Hugging Face conversion of a tiny random Llama written here with the `gguf`
package, named and laid out as llama.cpp's converter writes it."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from model_utils import CORPUS, make_tiny_model

from launch.model_cache.gguf import GGUFConversionError, convert_gguf
from launch.processing.chat_template import ChatTemplate
from launch.processing.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Q and K rows with the rotary halves interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _add_tokenizer(writer, hf_dir: str) -> None:
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in spec["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_chat_template(TEMPLATE)


def write_gguf(hf_dir: str, path: str, qtype=None) -> dict[str, np.ndarray]:
    """The HF model in `hf_dir` as a GGUF file (2-D weights quantized to `qtype` if given);
    returns the tensors a faithful reader must give back, by HF name."""
    from safetensors.numpy import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(writer, hf_dir)
    expected = {}
    for hf_name, w in sorted(tensors.items()):
        stored = w.astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            stored = _llama_cpp_permute(stored, heads)
        elif hf_name.endswith("k_proj.weight"):
            stored = _llama_cpp_permute(stored, kv_heads)
        if qtype is not None and stored.ndim == 2:
            quantized = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), quantized,
                              raw_dtype=qtype)
            # What the GGUF now holds, un-permuted: equal to w up to quantization error.
            w = gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype),
                                       qtype)
        else:
            writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), stored)
        expected[hf_name] = w.astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = make_tiny_model(str(root / "hf"), tokenizer=True)
    expected = write_gguf(hf_dir, str(root / "tiny.gguf"))
    return hf_dir, str(root / "tiny.gguf"), expected


def _converted_tensors(out_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(out_dir, "model.safetensors"))


def test_tensors_round_trip(tiny, tmp_path):
    _, gguf_file, expected = tiny
    out = convert_gguf(gguf_file, str(tmp_path / "out"))
    got = _converted_tensors(out)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(want)), name


def test_config_is_a_plain_llama(tiny, tmp_path):
    hf_dir, gguf_file, _ = tiny
    out = convert_gguf(gguf_file, str(tmp_path / "out"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(hf_dir, "config.json")) as f:
        original = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and config["dtype"] == "float32"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert config[key] == original[key], key


def test_tokenizer_and_chat_template_survive(tiny, tmp_path):
    hf_dir, gguf_file, _ = tiny
    out = convert_gguf(gguf_file, str(tmp_path / "out"))
    text = CORPUS[:200]
    assert load_tokenizer(out).encode(text) == load_tokenizer(hf_dir).encode(text)
    rendered = ChatTemplate.from_model_dir(out).render([{"role": "user", "content": "hi"}])
    assert rendered == "<|user|>hi<|endoftext|><|assistant|>"


def test_conversion_is_deterministic(tiny, tmp_path):
    _, gguf_file, _ = tiny
    paths = [os.path.join(convert_gguf(gguf_file, str(tmp_path / d)), "model.safetensors")
             for d in ("a", "b")]
    with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
        assert a.read() == b.read()


def test_quantized_tied_model_dequantizes_as_gguf_does(tmp_path):
    hf_dir = make_tiny_model(str(tmp_path / "hf"), tokenizer=True, tie_word_embeddings=True)
    expected = write_gguf(hf_dir, str(tmp_path / "q8.gguf"), gguf.GGMLQuantizationType.Q8_0)
    out = convert_gguf(str(tmp_path / "q8.gguf"), str(tmp_path / "out"))
    got = _converted_tensors(out)
    assert "lm_head.weight" not in got  # tied: stored once, as the embedding
    for name, want in expected.items():
        assert torch.equal(got[name], torch.from_numpy(want)), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is True


def test_bfloat16_output(tiny, tmp_path):
    _, gguf_file, expected = tiny
    got = _converted_tensors(convert_gguf(gguf_file, str(tmp_path / "out"), "bfloat16"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert got[name].dtype == torch.bfloat16
    assert torch.equal(got[name], torch.from_numpy(expected[name]).to(torch.bfloat16))


def test_refuses_what_it_cannot_convert(tmp_path):
    with pytest.raises(GGUFConversionError, match="no GGUF file"):
        convert_gguf(str(tmp_path / "missing.gguf"), str(tmp_path / "out"))
    writer = gguf.GGUFWriter(str(tmp_path / "qwen2.gguf"), "qwen2")  # metadata suffices
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    with pytest.raises(GGUFConversionError, match="'qwen2' model; supported: llama"):
        convert_gguf(str(tmp_path / "qwen2.gguf"), str(tmp_path / "out"))


def test_cli_convert(tiny, tmp_path, capsys):
    from launch.cli.main import main
    _, gguf_file, _ = tiny
    assert main(["convert", gguf_file, str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 2
    assert "no GGUF file" in capsys.readouterr().err
