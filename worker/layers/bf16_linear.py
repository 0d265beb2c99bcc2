"""How a bfloat16 linear multiplies on this CPU: bf16 products (oneDNN's `vdpbf16ps` or AMX
kernels) or float32 FMAs on a float32 copy of the weight.

Native bf16 is not always the faster multiply. On a Xeon with AVX512-BF16 but no AMX granted,
`vdpbf16ps zmm` issues once per two cycles (32 multiply-adds) where `vfmadd231ps zmm` issues
twice per cycle (2 x 16): float32 FMA does twice the multiply-adds per cycle, and oneDNN's
packed float32 linears ran 1.5-1.9x faster than its bf16 ones from 32 rows up (demo model
shapes, 2 threads). Below that the weights' bytes dominate, and bf16 (half of them) wins.
So, where float32 is measured faster, a bf16 linear keeps its packed bf16 weight for small row
counts and adds a packed float32 copy for `FLOAT32_ROWS` rows and more, taking and returning
float32 activations (the layers around it then run in float32: the model's bf16 KV cache and
attention are unchanged). Results are x · W.float()ᵀ in float32, closer to the float32 model
than bf16 products of rounded activations.

`route()` decides once per process: `DELTASERVE_BF16_LINEARS=float32|bfloat16` forces it,
else a short probe times oneDNN's packed bf16 and float32 products on one cache-resident
shape on one thread, interleaved, best of several, and takes float32 where it is `PROBE_MARGIN` x faster
(here 1.8x; with AMX granted bf16 is several times faster, so the answer is not close on
either kind of host). The copies cost memory: a weight is then held in 3x its bf16 bytes.
Before a model loads, `agree` takes the bfloat16 route instead where the whole model's
copies would not fit in what the host can give beside its weights and KV cache (a
`CopiesBudget`), and makes the ranks of a tensor-parallel group take one route.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch

from common.byte_size import byte_size
from worker.distributed.tensor_parallel import TensorParallel
from worker.layers import onednn_linear
from worker.native import gguf_ops

logger = logging.getLogger("deltaserve")

ENV_SWITCH = "DELTASERVE_BF16_LINEARS"
FLOAT32, BFLOAT16 = "float32", "bfloat16"
FLOAT32_ROWS = 32  # rows from which the float32 copy multiplies (below: the bf16 weight)
# Where the bf16 weight's plain rows are multiplied by gguf_matmul's dense driver instead (a
# CPU with the GGUF library), its bf16_panels kernel (worker/kernels/bf16_panels.h) reads the
# bf16 bytes once; against oneDNN's packed float32 copy (AVX-512 host, 2 threads, medians of
# 5 interleaved rounds, benchmarks/bench_dense_rows.py, three runs 05:38-05:57 UTC) it won at
# 16 and 32 rows in every run: LM head [M, 1024] x [32000, 1024] at 32 rows 8.1-8.2 vs
# 11.6-12.7 ms (13.4 vs 14.9 in a slow hour), q/k/v [2560, 1024] 0.66-0.95 vs 0.72-1.07 ms,
# o [1024, 2048] about even (0.51-0.84 vs 0.55-0.76). From 48 rows the copy won on q/k/v and
# o in two runs of three (48 rows run a half-empty 32-row tile), so with 16-lane (AVX-512)
# panels the copy takes over from PANEL_FLOAT32_ROWS rows; with 8-lane (AVX2) ones, not
# measured, from FLOAT32_ROWS as before.
PANEL_FLOAT32_ROWS = 33
COPY_ROWS_SWITCH = "DELTASERVE_BF16_COPY_ROWS"  # forces that bound (A/B runs)
PROBE_MARGIN = 1.3
_PROBE_SHAPE = (128, 512, 256)  # m, n, k: 16.8M multiply-adds, weights 256 KiB in bf16
_PROBE_ROUNDS = 5


def route() -> str:
    """FLOAT32 or BFLOAT16 (see the module docstring); BFLOAT16 without oneDNN packing. Where
    `agree` has run, its answer (while DELTASERVE_BF16_LINEARS is as it was then)."""
    settled = _settled.get(_switch())
    return settled if settled is not None else _own_route()


def _switch() -> str:
    return os.environ.get(ENV_SWITCH, "").strip()


def _own_route() -> str:
    forced = _switch()
    if forced:
        if forced not in (FLOAT32, BFLOAT16):
            raise ValueError(f"{ENV_SWITCH} must be {FLOAT32} or {BFLOAT16}, got {forced!r}")
        return forced
    if not onednn_linear.enabled(torch.device("cpu")):
        return BFLOAT16
    return _probed()


@dataclass(frozen=True)
class CopiesBudget:
    """Bytes of the whole model on this host (all its ranks) should its bf16 linears take
    the float32 route, and what the host can give."""

    copies: int  # the float32 copies the route would add
    weights: int  # the weights, still to load
    kv_cache: int  # the KV cache the engine will allocate
    available: int
    source: str  # where `available` comes from (worker/host/memory.py)

    def fits(self) -> bool:
        return self.weights + self.copies + self.kv_cache <= self.available

    def describe(self) -> str:
        return (f"float32 copies of {byte_size(self.copies)} do not fit beside "
                f"{byte_size(self.weights)} of weights and {byte_size(self.kv_cache)} of KV cache "
                f"in {byte_size(self.available)} ({self.source})")


_settled: dict[str, str] = {}  # the DELTASERVE_BF16_LINEARS value `agree` ran under -> its route


def agree(tp: TensorParallel, budget: CopiesBudget | None = None) -> str:
    """This process's route, settled before its model loads (every rank calls this once):
    its own (forced, or probed), bfloat16 where the probe's float32 route does not fit
    `budget`, and at TP > 1 the group's. Tensor-parallel ranks must multiply alike (the
    all-reduces sum activations of the route's dtype, and a rank on a loaded CPU can measure
    otherwise): the group takes the float32 route only where every rank would."""
    own = _own_route()
    if own == FLOAT32 and not _switch() and budget is not None and not budget.fits():
        logger.info("bf16 linears: %s: bfloat16 (one copy; %s=float32 forces the copies)",
                    budget.describe(), ENV_SWITCH)
        own = BFLOAT16
    chosen = own
    if tp.world_size > 1:
        votes = tp.all_reduce(torch.tensor([1.0 if own == FLOAT32 else 0.0]))
        chosen = FLOAT32 if int(votes.item()) == tp.world_size else BFLOAT16
        if chosen != own:
            logger.info("bf16 linears: rank %d would take %s; the tensor-parallel group "
                        "takes %s", tp.rank, own, chosen)
    _settled.clear()
    _settled[_switch()] = chosen
    return chosen


@functools.cache
def _probed() -> str:
    bf16_s, f32_s = _probe()
    chosen = FLOAT32 if bf16_s > PROBE_MARGIN * f32_s else BFLOAT16
    logger.info("bf16 linears: packed bf16 %.0f us, float32 %.0f us per probe product: %s "
                "from %d rows%s", bf16_s * 1e6, f32_s * 1e6, chosen, dense_float32_rows(),
                " (a float32 copy beside each bf16 weight; DELTASERVE_BF16_LINEARS=bfloat16 "
                "keeps one copy)" if chosen == FLOAT32 and not os.environ.get(ENV_SWITCH) else "")
    return chosen


def products_slow(dtype: torch.dtype) -> bool:
    """Whether this CPU's bf16 products (oneDNN's) measured PROBE_MARGIN x slower than its
    float32 FMAs, whatever DELTASERVE_BF16_LINEARS forces: a bf16 weight then multiplies as
    float32 on its own rows (gguf_matmul's dense driver) rather than through oneDNN's bf16."""
    return (dtype == torch.bfloat16 and onednn_linear.enabled(torch.device("cpu"))
            and _probed() == FLOAT32)


def _probe() -> tuple[float, float]:
    """Best seconds per product of oneDNN's packed bf16 and float32 linears, interleaved, on
    one thread (two threads on a shared, loaded host measured barrier waits, not products)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time_products()
    finally:
        torch.set_num_threads(threads)


def _time_products() -> tuple[float, float]:
    m, n, k = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    cases = [(x.bfloat16(), onednn_linear.pack(w.bfloat16())), (x, onednn_linear.pack(w))]
    best = [float("inf")] * 2
    for _ in range(_PROBE_ROUNDS):
        for i, (xi, wi) in enumerate(cases):
            onednn_linear.linear(xi, wi)
            start = time.perf_counter()
            for _ in range(3):
                onednn_linear.linear(xi, wi)
            best[i] = min(best[i], (time.perf_counter() - start) / 3)
    return best[0], best[1]


def float32_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed float32 copy a bf16 [out, in] weight multiplies with from FLOAT32_ROWS rows
    on this CPU, or None where bf16 products are kept (another dtype, not the CPU, no oneDNN,
    or `route()` says BFLOAT16)."""
    if (weight.dtype != torch.bfloat16 or not onednn_linear.enabled(weight.device)
            or route() != FLOAT32):
        return None
    packed = onednn_linear.pack(weight.detach().float())
    return packed if packed.is_mkldnn else None


@functools.cache
def dense_float32_rows() -> int:
    """Rows from which a bf16 weight on the float32 route multiplies by its float32 copy where
    the dense driver multiplies its plain rows below (see PANEL_FLOAT32_ROWS)."""
    forced = os.environ.get(COPY_ROWS_SWITCH, "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{COPY_ROWS_SWITCH} must be a positive row count, got {forced!r}")
        return int(forced)
    ops = gguf_ops.native()
    return PANEL_FLOAT32_ROWS if ops is not None and ops.simd_width == 16 else FLOAT32_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, weight_float32: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] (any float dtype) -> x Wᵀ + b [..., out] float32: the float32 copy from
    FLOAT32_ROWS rows, the (packed) bf16 weight below."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= FLOAT32_ROWS:
        return onednn_linear.linear(x.float(), weight_float32,
                                    None if bias is None else bias.float())
    out = onednn_linear.linear(x.to(weight.dtype), weight, bias)
    return out.float()
