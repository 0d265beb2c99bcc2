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
    writer.add_rope_freq_base(cfg.get("rope_theta")
                              or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
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


# Hugging Face names of a mixture-of-experts layer (after Mixtral's renames) -> GGUF's.
_MOE_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
              "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
            ".w2.": ".down_proj."}


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors (`...experts.{e}.{proj}.weight`) stacked into [E, out, in] under
    `...experts.{proj}.weight`, as llama.cpp's converter stores them."""
    import re
    out, stacks = {}, {}
    for name, w in tensors.items():
        for old, new in _MIXTRAL.items():
            name = name.replace(old, new)
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            stacks.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = w
        else:
            out[name] = w
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in sorted(experts)])
    return out


def write_moe_gguf(hf_dir: str, path: str, architecture: str,
                   qtype: Callable[[str], QType | None]) -> dict[str, np.ndarray]:
    """A Qwen3-MoE / Qwen2-MoE (`qwen3moe`, `qwen2moe`) or Mixtral (`llama`) directory as
    llama.cpp lays it out: stacked experts, q/k rows permuted for llama only, a 1-D shared
    expert gate; `qtype(name)` picks each 2-D/3-D tensor's type by its (common) HF name.
    Returns the tensors a faithful reader gives back (dequantized), by HF checkpoint name."""
    from safetensors.numpy import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, architecture)
    _add_config(writer, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if architecture != "llama":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    _add_tokenizer(writer, hf_dir)
    expected = {}
    tensors = _stack_experts(load_file(os.path.join(hf_dir, "model.safetensors")))
    for i, (hf_name, w) in enumerate(sorted(tensors.items())):
        stored = w.astype(np.float32)
        projection = hf_name.rsplit(".", 2)[-2]
        rope_heads = {"q_proj": heads, "k_proj": kv_heads}.get(projection) \
            if architecture == "llama" else None
        if rope_heads:
            stored = _llama_cpp_permute(stored, rope_heads)
        if hf_name.endswith("shared_expert_gate.weight"):
            stored = stored.reshape(-1)
        chosen = qtype(hf_name) if stored.ndim >= 2 else None
        gguf_name = _moe_gguf_name(hf_name)
        if chosen is None:
            writer.add_tensor(gguf_name, stored)
        else:
            rows = stored.reshape(-1, stored.shape[-1])
            blocks = quantized(rows, chosen, seed=i)
            writer.add_tensor(gguf_name, blocks.reshape(*stored.shape[:-1], -1), raw_dtype=chosen)
            stored = gguf.quants.dequantize(blocks, chosen).reshape(stored.shape)
        expected[hf_name] = (_unpermute(stored, rope_heads) if rope_heads else stored).reshape(
            w.shape)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    return expected


def _moe_gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    base, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_MOE_LAYER[base]}.{suffix}"
