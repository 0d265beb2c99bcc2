"""GGUF -> Hugging Face conversion of a tiny random Llama written here with the `gguf`
package, named and laid out as llama.cpp's converter writes it."""
from __future__ import annotations

import json
import os

import gguf
import pytest
import torch
from gguf_utils import write_gguf
from model_utils import CORPUS, make_tiny_model

from launch.model_cache.gguf import GGUFConversionError, convert_gguf
from launch.processing.chat_template import ChatTemplate
from launch.processing.tokenizer import load_tokenizer


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
