"""The GGML block formats the GGUF kernels multiply (worker/native/gguf_ops.py): each type's
block layout, a tensor's bytes as rows of blocks, valid random blocks for tests and
benchmarks, and `gguf.quants.dequantize` as the kernels' reference.

  qweight  uint8 [N, row_bytes] (row_bytes = K / block_elems * block_bytes), bytes of a row
           contiguous, any row stride; or a contiguous 1-D uint8 tensor of N * row_bytes bytes
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GgufType:
    """A GGML block format: `block_elems` weights in `block_bytes` bytes, with float16 scale
    fields (d, and m / dmin where the type has one) at `scale_offsets` within a block."""
    name: str
    code: int  # gguf.GGMLQuantizationType value
    block_elems: int
    block_bytes: int
    scale_offsets: tuple[int, ...]

    def row_bytes(self, k: int) -> int:
        if k <= 0 or k % self.block_elems:
            raise ValueError(f"{self.name}: K={k} is not a positive multiple of "
                             f"{self.block_elems}")
        return k // self.block_elems * self.block_bytes


_TYPES = (GgufType("Q4_0", 2, 32, 18, (0,)), GgufType("Q4_1", 3, 32, 20, (0, 2)),
          GgufType("Q5_0", 6, 32, 22, (0,)), GgufType("Q5_1", 7, 32, 24, (0, 2)),
          GgufType("Q8_0", 8, 32, 34, (0,)), GgufType("Q4_K", 12, 256, 144, (0, 2)),
          GgufType("Q5_K", 13, 256, 176, (0, 2)), GgufType("Q6_K", 14, 256, 210, (208,)),
          # GGML's plain int8 (w = q), run in blocks of 32 (K a multiple of 32): the weights of
          # weight-only int8, whose per-row scales the caller applies to the products.
          GgufType("I8", 24, 32, 32, ()))
# The types with kernels, by name and by code (a gguf.GGMLQuantizationType works as a code).
GGUF_TYPES: dict[str | int, GgufType] = {**{t.name: t for t in _TYPES},
                                          **{t.code: t for t in _TYPES}}


def gguf_type(qtype: str | int) -> GgufType:
    try:
        return GGUF_TYPES[qtype]
    except KeyError:
        raise ValueError(f"no GGUF kernel for type {qtype!r}") from None


def supported(qtype: str | int) -> bool:
    """A kernel exists for this GGML type (by name, code or GGMLQuantizationType)."""
    return qtype in GGUF_TYPES


def weight_rows(qweight: torch.Tensor, t: GgufType, n: int, k: int) -> torch.Tensor:
    """qweight as [n, row_bytes] uint8 CPU bytes with contiguous rows (a view; raises
    otherwise)."""
    row = t.row_bytes(k)
    if qweight.dtype != torch.uint8 or not qweight.is_cpu:
        raise TypeError(f"qweight must be uint8 bytes on the CPU, not {qweight.dtype} on "
                        f"{qweight.device}")
    if qweight.dim() == 2 and qweight.stride(1) == 1 and qweight.shape == (n, row):
        return qweight
    if qweight.dim() == 1 and qweight.is_contiguous() and qweight.numel() == n * row:
        return qweight.view(n, row)
    raise ValueError(f"qweight must be [{n}, {row}] uint8 with contiguous rows ({t.name}, "
                     f"K={k}), got {tuple(qweight.shape)} strides {qweight.stride()}")


def random_blocks(qtype: str | int, n: int, k: int, generator: torch.Generator,
                  scale: float = 2.0 ** -6) -> torch.Tensor:
    """[n, row_bytes] uint8 of valid random blocks (for tests and benchmarks): random bytes
    for the quants and packed sub-scales, float16 scale fields in ±[scale / 2, scale]."""
    t = gguf_type(qtype)
    blocks = torch.randint(0, 256, (n, k // t.block_elems, t.block_bytes), dtype=torch.uint8,
                           generator=generator)
    for offset in t.scale_offsets:
        magnitude = torch.rand(blocks.shape[:2], generator=generator) * 0.5 + 0.5
        sign = torch.randint(0, 2, blocks.shape[:2], generator=generator) * 2 - 1
        d = (magnitude * sign * scale).to(torch.float16)
        blocks[:, :, offset:offset + 2] = d.view(torch.uint8).view(n, -1, 2)
    return blocks.view(n, -1)


def dequantize_reference(qweight: torch.Tensor, qtype: str | int, n: int,
                         k: int) -> torch.Tensor:
    """float32 [N, K] by gguf.quants.dequantize (the kernels' reference and fallback)."""
    import gguf.quants

    t = gguf_type(qtype)
    w = weight_rows(qweight, t, n, k).contiguous()
    if t.name == "I8":  # gguf.quants has no I8 decoder: the values are the weights
        return w.view(torch.int8).float()
    return torch.from_numpy(gguf.quants.dequantize(w.numpy(), t.code).reshape(n, k))
