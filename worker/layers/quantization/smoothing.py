"""SmoothQuant at load time for `--quantization w8a8` (Xiao et al. 2023; what llm-compressor
does before it writes a vLLM W8A8 checkpoint).

Per-token int8 activations lose the small channels of a token whose few outlier channels set
its scale. Smoothing moves that range into the weights, exactly in float: for a linear layer
y = x Wᵀ with input channel j, x_j / s_j and W[:, j] · s_j give the same y, and the division
is folded into the op that produces x, so nothing is added at run time:

- input_layernorm → qkv_proj and post_attention_layernorm → gate_up_proj: the RMSNorm weight
  g_j becomes g_j / s_j (norm weights are float32);
- v rows → o_proj: attention output (head h, channel c) is a convex mix of v rows of h's KV
  head, so v row (g, c) / s_{g,c} divides every query head of group g at channel c; s is
  shared per (KV head, channel), and o_proj's columns (h, c) take s_{group(h),c};
- up rows → down_proj: silu(gate) · up / s_j, down's column j · s_j.

s_j = max|X_j|^α / max|W_j|^(1-α), X's maxima from one float32 forward over the built-in
calibration text (calibration_text.py, not the evaluation text), W's over the layer's output
rows (every rank's for the norms, which all ranks share). Then the smoothed weights are
quantized per channel as before; the run-time semantics (dynamic per-token symmetric int8
activations, per-channel int8 weights, the same kernels) do not change.

Tensor parallelism: the calibration forward runs on each rank's shards with the same
all-reduces as the model, so the norms' (replicated) activation maxima agree; their weight
maxima are gathered over the ranks. v/o_proj and up/down_proj are rank-local.
A model with layers of another shape (MoE MLPs, Gemma's norms and extra sublayers) keeps its
weights as they are; `smoothing` off (--no-w8a8-smoothing) is for checkpoints that are smoothed already.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.layernorm import RMSNorm
from worker.layers.quantization.calibration_text import CALIBRATION_TEXT

logger = logging.getLogger(__name__)

# Migration strength, chosen on the calibration text: the α of least mean KL divergence from
# the float32 model's next-token distributions there, SmolLM2-135M, α in 0.4..0.7 (0.4:
# 0.0113, 0.5: 0.0088, 0.55: 0.0084, 0.6: 0.0088, 0.7: 0.0098; unsmoothed 0.0306).
DEFAULT_ALPHA = 0.55
# The text is calibrated as sequences of this many tokens (fewer if the model's positions
# are fewer), so the factors do not depend on --max-model-len.
CALIBRATION_WINDOW = 256
_FLOOR = 1e-5  # maxima below this (dead channels) count as this


def calibration_ids(model_dir: str) -> torch.Tensor | None:
    """The calibration text's token ids by the model's tokenizer.json (None without one)."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return torch.tensor(Tokenizer.from_file(path).encode(CALIBRATION_TEXT).ids)


def smooth_model(model: nn.Module, tp: TensorParallel, model_dir: str,
                 alpha: float = DEFAULT_ALPHA) -> int:
    """Calibrate and fold the smoothing factors into `model`'s (float, not yet quantized)
    weights; returns how many products were smoothed (0: the model's shape is not one this
    knows, or no tokenizer)."""
    layers = _smoothable_layers(model)
    ids = calibration_ids(model_dir) if layers else None
    if not layers or ids is None:
        logger.warning("w8a8: no smoothing (%s)", "no tokenizer.json" if layers
                       else "layers of an unknown shape")
        return 0
    window = min(CALIBRATION_WINDOW, model.model.rotary_of(0).cos.shape[0])
    ranges = [_merge(parts) for parts in zip(*(calibrate(model, tp, chunk)[0]
                                               for chunk in ids.split(window)))]
    done = 0
    for layer, r in zip(layers, ranges):
        attn, mlp = layer.self_attn, layer.mlp
        _smooth_norm(layer.input_layernorm, attn.qkv_proj, r["qkv"], tp, alpha)
        _smooth_v_o(attn, r["o"], alpha)
        _smooth_norm(layer.post_attention_layernorm, mlp.gate_up_proj, r["gate_up"], tp, alpha)
        _smooth_up_down(mlp, r["down"], alpha)
        done += 4
    logger.info("w8a8: smoothed %d products (alpha %.2f, %d calibration tokens)", done,
                alpha, ids.numel())
    return done


def _merge(parts: tuple[dict, ...]) -> dict:
    return {name: torch.stack([p[name] for p in parts]).amax(0) for name in parts[0]}


def _smoothable_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, if every one is a pre-norm Llama-shaped layer (plain RMSNorms,
    qkv/o attention, a gate/up/down MLP, nothing else); else []. (The folding is exact for
    any such layer; the calibration forward, full causal attention, only sets the factors.)"""
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", []))
    if not layers or not hasattr(inner, "embed_tokens") or not hasattr(inner, "rotary_of"):
        return []
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = (getattr(layer, "input_layernorm", None),
                 getattr(layer, "post_attention_layernorm", None))
        if (not all(hasattr(attn, n) for n in ("qkv_proj", "o_proj"))
                or not all(hasattr(mlp, n) for n in ("gate_up_proj", "down_proj"))
                or any(type(n) is not RMSNorm for n in norms)
                or {name for name, _ in layer.named_children()} != {
                    "input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}):
            return []
    return layers


@torch.no_grad()
def calibrate(model: nn.Module, tp: TensorParallel,
              ids: torch.Tensor) -> tuple[list[dict], torch.Tensor]:
    """One float32 forward of `ids` (one sequence) over this rank's float weights: per layer
    the maxima over tokens of |x_j| at each smoothed product's input (qkv, gate_up [hidden],
    o [this rank's heads · head_dim], down [this rank's intermediate]), and the residual
    stream after the last layer [n, hidden]."""
    inner = model.model
    positions = torch.arange(ids.numel())
    h = inner.embed_tokens(ids).float()
    out = []
    for i, layer in enumerate(inner.layers):
        r: dict[str, torch.Tensor] = {}
        x = layer.input_layernorm.forward_torch(h, torch.float32)
        r["qkv"] = x.abs().amax(0)
        o_in = _attention(layer.self_attn, x, positions, inner.rotary_of(i))
        r["o"] = o_in.abs().amax(0)
        h += _row_parallel(layer.self_attn.o_proj, o_in)
        x = layer.post_attention_layernorm.forward_torch(h, torch.float32)
        r["gate_up"] = x.abs().amax(0)
        gate, up = _linear(layer.mlp.gate_up_proj, x).chunk(2, dim=-1)
        a = F.silu(gate) * up
        r["down"] = a.abs().amax(0)
        h += _row_parallel(layer.mlp.down_proj, a)
        out.append(r)
    return out, h


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x, layer.weight.float(), bias)


def _row_parallel(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = layer.tp.all_reduce(F.linear(x, layer.weight.float()))
    return y if layer.bias is None else y + layer.bias.float()


def _attention(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor,
               rotary: nn.Module) -> torch.Tensor:
    """This rank's heads' causal attention output [n, num_heads · head_dim]."""
    n, d = x.shape[0], attn.head_dim
    q, k, v = _linear(attn.qkv_proj, x).split(
        [attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d], dim=-1)
    q, k, v = q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm.forward_torch(q), attn.k_norm.forward_torch(k)
    q, k = rotary.forward_torch(positions, q, k)
    group = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, scale=attn.scale)
    return o.transpose(0, 1).reshape(n, attn.num_heads * d)


def _factors(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    return (x_max.clamp(min=_FLOOR).pow(alpha) / w_max.clamp(min=_FLOOR).pow(1 - alpha)
            ).clamp(min=_FLOOR)


def _smooth_norm(norm: RMSNorm, linear: nn.Module, x_max: torch.Tensor, tp: TensorParallel,
                 alpha: float) -> None:
    """norm weight / s, linear's columns · s (s over the hidden channels, the same on every
    rank: the weight maxima over all ranks' rows)."""
    w = linear.weight.data.float()
    w_max = w.abs().amax(0)
    if tp.world_size > 1:
        w_max = tp.all_gather(w_max.unsqueeze(0)).view(tp.world_size, -1).amax(0)
    s = _factors(x_max, w_max, alpha)
    norm.weight.data.div_(s)
    linear.weight.data = w * s


def _smooth_v_o(attn: nn.Module, o_max: torch.Tensor, alpha: float) -> None:
    """v rows of KV head g / s[g], o_proj's columns of g's query heads · s[g] (s [kv, d])."""
    d, kv = attn.head_dim, attn.num_kv_heads
    group = attn.num_heads // kv
    o = attn.o_proj.weight.data.float()
    x_max = o_max.view(kv, group, d).amax(1)
    w_max = o.abs().amax(0).view(kv, group, d).amax(1)
    s = _factors(x_max, w_max, alpha)  # [kv, d]
    qkv = attn.qkv_proj
    w = qkv.weight.data.float()
    v_start = (attn.num_heads + kv) * d
    w[v_start:] /= s.reshape(-1, 1)
    if qkv.bias is not None:
        qkv.bias.data[v_start:] /= s.reshape(-1).to(qkv.bias.dtype)
    qkv.weight.data = w
    attn.o_proj.weight.data = (o.view(o.shape[0], kv, group, d) * s[None, :, None, :]
                               ).view(o.shape)


def _smooth_up_down(mlp: nn.Module, down_max: torch.Tensor, alpha: float) -> None:
    """up rows / s, down_proj's columns · s (this rank's intermediate channels)."""
    down = mlp.down_proj.weight.data.float()
    s = _factors(down_max, down.abs().amax(0), alpha)
    gate_up = mlp.gate_up_proj
    w = gate_up.weight.data.float()
    inter = w.shape[0] // 2
    w[inter:] /= s[:, None]
    if gate_up.bias is not None:
        gate_up.bias.data[inter:] /= s.to(gate_up.bias.dtype)
    gate_up.weight.data = w
    mlp.down_proj.weight.data = down * s
