"""Tiny GGUF files written with the `gguf` package, named and laid out as llama.cpp's converter
writes them (q/k rows permuted for its RoPE layout, shapes innermost first)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import gguf
import numpy as np

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
QType = gguf.GGMLQuantizationType
# Where the float16 scale fields of the types gguf.quants cannot quantize lie in a block.
_SCALE_OFFSETS = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2),
                  QType.Q5_K: (0, 2), QType.Q6_K: (208,)}
# A type for each 2-D tensor by its Hugging Face name (None: float32), or one type for all.
TypeChoice = QType | Callable[[str], QType | None] | None


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


def _add_config(writer, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])


def _type_of(qtype: TypeChoice, hf_name: str, ndim: int) -> QType | None:
    if ndim != 2 or qtype is None:
        return None
    return qtype(hf_name) if callable(qtype) else qtype


def quantized(w: np.ndarray, qtype: QType, seed: int) -> np.ndarray:
    """`w` quantized to `qtype` where gguf.quants can; else valid random blocks of its shape
    (random quants, scales of about 2^-10), as the K-quants have no quantizer there."""
    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        elems, size = gguf.GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // elems, size), np.uint8)
        for offset in _SCALE_OFFSETS[qtype]:
            d = rng.uniform(2.0 ** -11, 2.0 ** -10, blocks.shape[:2]).astype(np.float16)
            blocks[:, :, offset:offset + 2] = d[..., None].view(np.uint8)
        return blocks.reshape(w.shape[0], -1)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir: str, path: str, qtype: TypeChoice = None, architecture: str = "llama",
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The HF model in `hf_dir` as a GGUF file (2-D weights quantized as `qtype` says, plus
    `extra` tensors by GGUF name); returns the tensors a faithful reader must give back, by
    HF name (dequantized)."""
    from safetensors.numpy import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, architecture)
    _add_config(writer, cfg)
    _add_tokenizer(writer, hf_dir)
    expected = {}
    for i, (hf_name, w) in enumerate(sorted(tensors.items())):
        stored = w.astype(np.float32)
        rope_heads = {"q_proj": heads, "k_proj": kv_heads}.get(hf_name.rsplit(".", 2)[-2])
        if rope_heads:
            stored = _llama_cpp_permute(stored, rope_heads)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
        chosen = _type_of(qtype, hf_name, stored.ndim)
        if chosen is not None:
            blocks = quantized(stored, chosen, seed=i)
            writer.add_tensor(gguf_name, blocks, raw_dtype=chosen)
            # What the GGUF now holds, un-permuted (quantizing commutes with the row order).
            stored = gguf.quants.dequantize(blocks, chosen)
        writer.add_tensor(gguf_name, stored) if chosen is None else None
        expected[hf_name] = _unpermute(stored, rope_heads) if rope_heads else stored
    for gguf_name, data in (extra or {}).items():
        writer.add_tensor(gguf_name, data)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    return expected
